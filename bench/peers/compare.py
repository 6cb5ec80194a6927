#!/usr/bin/env python3
"""Markdown tables of jaxspec's e2e figures against the transformers and keras-hub peers (issue #6).

    python bench/peers/compare.py --e2e e2e-1k.json[,e2e-4k.json] --hf peer-hf.json --keras peer-keras.json [--md OUT]

Inputs (any of --hf / --keras may be left out):
  --e2e    JSON of `python -m jaxspec.bench e2e` (one per prompt length; the prompt length, new tokens and k are read
           from a row's `prompt_len` / `new_tokens` / `k` when present, else from the recorded command line)
  --hf     JSON of bench/peers/hf_peer.py;  --keras  JSON of bench/peers/keras_peer.py

Matching: bs 1 rows of the e2e JSON, prompt length = the peers' ctx. jaxspec plain = mode `off`, speculative = mode
`bucketed` (or --spec-mode). tokens/s are decode tokens/s (tokens after the first / time after the first token, as
jaxspec's e2e reports them); where a peer has no decode-only figure, its prefill-included figure is used and the
cell says "(incl. prefill)". jaxspec's prefill-included figure is estimated as N / (TTFT + (N - 1) / decode tok/s).
"""

from __future__ import annotations

import argparse
import json
import shlex


def load(path):
    with open(path) as f:
        return json.load(f)


def e2e_settings(record) -> dict:
    """prompt_len / new_tokens / k of an e2e run, from its command line (jaxspec.bench's defaults otherwise)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--preset", default="E4B")
    words = shlex.split(record.get("command", ""))
    ns, _ = p.parse_known_args(words)
    return {"prompt_len": ns.prompt_len, "new_tokens": ns.new_tokens, "k": ns.k, "preset": ns.preset}


def ours_by_ctx(paths, spec_mode: str) -> dict:
    """{ctx: {"plain": row, "spec": row, "eager": row, "settings": ...}} from bs-1 rows of e2e JSONs."""
    out = {}
    for path in paths:
        rec = load(path)
        base = e2e_settings(rec)
        base["preset"] = rec.get("preset", base["preset"])
        for r in rec.get("rows", []):
            if r.get("bs") != 1:
                continue
            s = dict(base, **{k: r[k] for k in ("prompt_len", "new_tokens", "k") if k in r})
            slot = out.setdefault(s["prompt_len"], {"settings": s})
            mode = r.get("mode")
            if mode == "off":
                slot["plain"] = r
            elif mode == spec_mode:
                slot["spec"] = r
            elif mode == "eager":
                slot["eager"] = r
    return out


def incl_prefill(row, n):
    """jaxspec's tokens/s including prefill, from TTFT and decode tokens/s."""
    if not row or not row.get("decode_tokens_per_s") or row.get("ttft_ms_mean") is None:
        return None
    return n / (row["ttft_ms_mean"] / 1e3 + (n - 1) / row["decode_tokens_per_s"])


def peer_rows(path) -> dict:
    if not path:
        return {}
    rec = load(path)
    return {r["ctx"]: dict(r, _record=rec) for r in rec.get("rows", [])}


def round_ms(row) -> float | None:
    if not row:
        return None
    parts = [row.get(f"{k}_ms_per_round") for k in ("draft", "verify", "host")]
    return sum(parts) if all(p is not None for p in parts) else None


def peer_tps(row, mode):
    """(tokens/s, decode-only?) of a peer row for mode plain/assisted."""
    if not row:
        return None, True
    v = row.get(f"{mode}_decode_tokens_per_s")
    if v is not None:
        return v, True
    return row.get(f"{mode}_tokens_per_s_incl_prefill"), False


def fmt(v, f="{:.1f}"):
    return "–" if v is None else f.format(v)


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def build_tables(ours, hf, keras) -> str:
    ctxs = sorted(set(ours) | set(hf) | set(keras))
    lines = []
    peers = []
    for name, rows in (("transformers", hf), ("keras-hub", keras)):
        if rows:
            rec = next(iter(rows.values()))["_record"]
            peers.append(f"{name} ({', '.join(f'{k} {v}' for k, v in rec.get('versions', {}).items())}; "
                         f"{rec.get('device', '?')}; N = {rec.get('new_tokens')} new tokens, k = {rec.get('k')})")
    if peers:
        lines.append("Peers: " + "; ".join(peers) + ".\n")

    # decode tokens/s
    lines += ["| prompt | mode | jaxspec tok/s | transformers tok/s | keras-hub tok/s | jaxspec / transformers | "
              "jaxspec / keras-hub |", "|---|---|---|---|---|---|---|"]
    for ctx in ctxs:
        o = ours.get(ctx, {})
        for mode, our_key, peer_mode in (("plain greedy", "plain", "plain"), ("speculative (k=3)", "spec", "assisted")):
            mine = (o.get(our_key) or {}).get("decode_tokens_per_s")
            h, h_dec = peer_tps(hf.get(ctx), peer_mode)
            k, k_dec = peer_tps(keras.get(ctx), peer_mode)
            kcell = fmt(k) + ("" if k_dec or k is None else " (incl. prefill)")
            hcell = fmt(h, "{:.2f}") + ("" if h_dec or h is None else " (incl. prefill)")
            lines.append(f"| {ctx} | {mode} | {fmt(mine)} | {hcell} | {kcell} | {fmt(ratio(mine, h), '{:.1f}×')} | "
                         f"{fmt(ratio(mine, k), '{:.2f}×')} |")

    # prefill included (keras-hub's natural figure)
    lines += ["", "Prefill included (N new tokens / wall time of the whole generate; jaxspec estimated from TTFT):", "",
              "| prompt | mode | jaxspec tok/s | transformers tok/s | keras-hub tok/s | jaxspec / transformers | "
              "jaxspec / keras-hub |", "|---|---|---|---|---|---|---|"]
    for ctx in ctxs:
        o = ours.get(ctx, {})
        n = o.get("settings", {}).get("new_tokens", 64)
        for mode, our_key, peer_mode in (("plain greedy", "plain", "plain"), ("speculative (k=3)", "spec", "assisted")):
            mine = incl_prefill(o.get(our_key), n)
            h = (hf.get(ctx) or {}).get(f"{peer_mode}_tokens_per_s_incl_prefill")
            k = (keras.get(ctx) or {}).get(f"{peer_mode}_tokens_per_s_incl_prefill")
            lines.append(f"| {ctx} | {mode} | {fmt(mine)} | {fmt(h, '{:.2f}')} | {fmt(k)} | "
                         f"{fmt(ratio(mine, h), '{:.1f}×')} | {fmt(ratio(mine, k), '{:.2f}×')} |")

    # draft loop and round vs transformers
    lines += ["", "Per speculative round at bs 1 (jaxspec: engine round split; transformers: `get_candidates` with "
              "CUDA syncs, median over the rounds; its round = (assisted time - its prefill) / rounds):", "",
              "| prompt | jaxspec draft ms | transformers draft ms | draft ratio | jaxspec round ms | "
              "transformers round ms | round ratio | accept (jaxspec / transformers) |",
              "|---|---|---|---|---|---|---|---|"]
    for ctx in ctxs:
        spec = ours.get(ctx, {}).get("spec")
        h = hf.get(ctx) or {}
        d_mine = (spec or {}).get("draft_ms_per_round")
        d_hf = h.get("draft_ms_per_round_median")
        r_mine, r_hf = round_ms(spec), h.get("round_ms")
        acc = f"{fmt((spec or {}).get('mean_accept_length'), '{:.2f}')} / {fmt(h.get('mean_accept_length'), '{:.2f}')}"
        lines.append(f"| {ctx} | {fmt(d_mine, '{:.3f}')} | {fmt(d_hf, '{:.2f}')} | "
                     f"{fmt(ratio(d_hf, d_mine), '{:.0f}×')} | {fmt(r_mine, '{:.3f}')} | {fmt(r_hf, '{:.2f}')} | "
                     f"{fmt(ratio(r_hf, r_mine), '{:.1f}×')} | "
                     f"{acc} |")

    checks = []
    for name, rows in (("transformers", hf), ("keras-hub", keras)):
        for ctx, r in sorted(rows.items()):
            if r.get("assisted_equals_plain") is False:
                checks.append(f"{name} at {ctx}: assisted output differs from plain greedy")
    if checks:
        lines += ["", "**Warnings:** " + "; ".join(checks)]
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--e2e", default="", help="jaxspec e2e JSON(s), comma-separated")
    p.add_argument("--hf", help="hf_peer.py JSON")
    p.add_argument("--keras", help="keras_peer.py JSON")
    p.add_argument("--spec-mode", default="bucketed", help="jaxspec draft mode compared with the assisted peers")
    p.add_argument("--md", help="also write the tables to this file")
    args = p.parse_args(argv)
    ours = ours_by_ctx([x for x in args.e2e.split(",") if x], args.spec_mode)
    text = build_tables(ours, peer_rows(args.hf), peer_rows(args.keras))
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
