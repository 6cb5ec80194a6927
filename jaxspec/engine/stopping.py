"""When a request ends: EOS, stop strings, max_new_tokens, the context. The host commits a round's tokens through
here one by one; the device applies the same rules, except stop strings, to decide when to stop computing a row
(`jaxspec.engine.programs`), so the device never stops a row the host still runs."""

from __future__ import annotations

from jaxspec.engine.request import Request


class Stopping:
    def __init__(self, *, eos: set[int], tokenizer, k: int, max_context: int):
        self.eos, self.tokenizer, self.k, self.max_context = eos, tokenizer, k, max_context

    def commit(self, r: Request, new_tokens, now: float) -> int:
        """Append committed tokens one by one, stopping at EOS, a stop string, max_new_tokens or the context.
        Returns how many were appended."""
        before = len(r.output_ids)
        for t in new_tokens:
            r.tokens.append(t)
            r.output_ids.append(t)
            if not r.params.ignore_eos and t in self.eos:
                r.finish_reason = "stop"
            elif len(r.output_ids) >= r.params.max_new_tokens:
                r.finish_reason = "length"
            elif r.params.stop and self.tokenizer is not None and self.stop_seen(r):
                r.finish_reason = "stop"
            if r.finish_reason:
                break
        if not r.finish_reason and len(r.tokens) + self.k + 1 > self.max_context:
            r.finish_reason = "length"  # no room for another round
        if r.finish_reason:
            self.finish(r, now)
        return len(r.output_ids) - before

    def finish(self, r: Request, now: float) -> None:
        r.t_done = now
        if self.tokenizer is not None:
            r.text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            for s in r.params.stop:
                if s in r.text:
                    r.text = r.text[: r.text.index(s)]

    def stop_seen(self, r: Request) -> bool:
        """Whether the output now holds a stop string. A new match ends in the last token, so it lies in the text of
        the last 4 * len(stop) + 8 tokens (a token is at least one byte, a character at most four): decode only that
        tail, and confirm a tail hit on the whole output (a tail's first characters may decode differently). Host work
        per token stays bounded instead of growing with the output."""
        tail = 4 * max(len(s) for s in r.params.stop) + 8
        if not any(s in self.tokenizer.decode(r.output_ids[-tail:]) for s in r.params.stop):
            return False
        text = self.tokenizer.decode(r.output_ids)
        return any(s in text for s in r.params.stop)
