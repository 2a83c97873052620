"""Engine stage: incremental detokenization and stop strings for one completion.

Text grows token by token through `tokenizers`' DecodeStream, which holds back bytes of
a multi-byte character split across tokens (and byte-fallback pieces) until the
character is complete; what it has emitted is always a prefix of the full decode. At the
end the rest of the full decode is flushed, so the final text equals
`tokenizer.decode(all_token_ids)` exactly. DecodeStream gives up on some invalid byte
sequences (a model can emit any token sequence); the completion then falls back to
re-decoding all its tokens each step, which is slower but never wrong at the end.

Stop strings are searched in the text as it grows, so they are found across token
boundaries. While a completion runs, the last (longest stop - 1) characters are held
back from the streamed deltas, since they could be the start of a stop string that is
cut from the output.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_string: str | None = None  # the stop string that ended the text
        self._num_sent_chars = 0

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now ends the completion."""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            if self.stop_string is not None:
                continue
            chunk = self._decode_next(token_id)
            if chunk and self._append(chunk):
                return self.stop_string
        return None

    def finish(self) -> str | None:
        """Flush characters still held by the stream (e.g. an incomplete UTF-8 tail)."""
        if self.stop_string is not None:
            return self.stop_string
        full = self._full_decode()
        if full.startswith(self.text):
            if len(full) > len(self.text):
                self._append(full[len(self.text) :])
        else:
            # Only after the fallback met invalid bytes: the final text is still exact.
            self.text = ""
            self._num_sent_chars = min(self._num_sent_chars, len(full))
            self._append(full)
        return self.stop_string

    def _full_decode(self) -> str:
        return self._backend.decode(self.token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self, token_id: int) -> str | None:
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id)
            except Exception as e:  # the library raises a bare Exception here
                logger.debug("DecodeStream gave up (%s); re-decoding from the start", e)
                self._stream = None
        full = self._full_decode()
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return None  # an incomplete character, or text that will be fixed at the end
        return full[len(self.text) :]

    def take_delta(self, finished: bool) -> str:
        """Text not streamed yet, minus a possible stop-string prefix while running."""
        limit = len(self.text)
        if not finished and self.stop_string is None:
            limit = max(self._num_sent_chars, limit - self._holdback)
        delta = self.text[self._num_sent_chars : limit]
        self._num_sent_chars = max(self._num_sent_chars, limit)
        return delta

    def _append(self, chunk: str) -> bool:
        """Add decoded text and look for a stop string in what is new; True if stopped."""
        start = max(0, len(self.text) - self._holdback)
        self.text += chunk
        if not self._stop:
            return False
        found_at, found = -1, None
        for stop in self._stop:
            position = self.text.find(stop, start)
            if position != -1 and (found is None or position < found_at):
                found_at, found = position, stop
        if found is None:
            return False
        end = found_at + len(found) if self._include_stop else found_at
        self.text = self.text[:end]
        self.stop_string = found
        return True
