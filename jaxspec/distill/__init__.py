"""Distillation of a `gemma4_assistant` drafter for a frozen target, on the target's own greedy continuations, with
exactly the objective the drafter is used with (DESIGN.md §3). `python -m jaxspec.distill` runs it (`__main__`).

Data (`data`): prompts -> the target's greedy continuation (jitted dense forward, batched) -> one teacher-forced
dense forward over prompt + continuation giving, per position, the post-norm hidden and the store-layer K/V.

Example at continuation position p (cached_len = p): pending token tok[p], seed hidden hidden[p-1]; every drafter
layer attends its store layer's K/V window (full: [0, p); sliding: the last W+1 positions); k recurrent steps at
position p, step j+1 fed the teacher token tok[p+j] (a wrong draft rejects the rest anyway) and step j's h_next;
step j predicts tok[p+j]. All positions of a sequence run in parallel through the engine's own `draft_hidden`, with a
training `attend` that masks per query (`objective`).

Head (`objective`): the plain tied head over a reduced vocabulary. Only the K most frequent target outputs of the
training data get trainable rows; every other row is exactly zero (logit 0 at inference), so the loss is the exact
inference head's: logsumexp = logaddexp(lse(kept logits), log(V - K)), never the V-wide vector.

Precision (`train`): fp32 master params and optimiser state; the forward runs in --dtype (bf16 on a GPU: bf16
weights and activations, fp32 norms and accumulation, as the engine runs it).

Outputs (`export`): the HF assistant folder, its packed form for shipping (`jaxspec.model.packed`) and distill.json.
"""
