"""The llama.cpp backend's batching and bookkeeping, driven through a stand-in for the
low-level `llama_cpp` API (llama-cpp-python need not be installed).

The stand-in keeps each sequence's KV as the list of tokens fed to it and checks every
token's position against it, and its toy model's next token depends on the whole
sequence: a token fed to the wrong sequence, at the wrong position, or onto the stale KV
of a finished request changes the output or fails the check at once.
"""

from __future__ import annotations

import ctypes
import random
from types import SimpleNamespace

import pytest

from pagellm.bench.llamacpp_backend import decode_all, run_llamacpp
from pagellm.errors import PagellmError
from pagellm.workload.synthetic import BenchRequest

N_VOCAB = 97


def next_token(tokens: list[int]) -> int:
    """The toy model: greedy next token of a sequence (depends on every token and position)."""
    return sum((k + 1) * t for k, t in enumerate(tokens)) % N_VOCAB


def expected_output(request: BenchRequest) -> list[int]:
    tokens, out = list(request.prompt_token_ids), []
    for _ in range(request.output_len):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


class FakeBatch:
    """llama_batch_init's struct: per-row arrays of n_batch entries."""

    def __init__(self, n_batch: int, n_seq_max: int) -> None:
        self.n_tokens = 0
        self.token = [0] * n_batch
        self.pos = [0] * n_batch
        self.n_seq_id = [0] * n_batch
        self.seq_id = [[0] * n_seq_max for _ in range(n_batch)]
        self.logits = [False] * n_batch


class FakeLlamaCpp:
    """The calls the backend makes; `seq_rm_api` picks which name llama.cpp's version uses
    for dropping a sequence's KV."""

    def __init__(self, n_batch: int, parallel: int, seq_rm_api: str = "memory") -> None:
        self.n_batch = n_batch
        self.parallel = parallel
        self.kv: dict[int, list[int]] = {}  # seq id -> tokens in the cache, by position
        self.admitted: list[int] = []  # seq id of each sequence started (position 0)
        self.removed: list[int] = []  # seq ids whose KV was dropped, in order
        self.events: list[tuple[str, int]] = []  # ("admit" | "drop", seq id), in order
        self.batch_sizes: list[int] = []
        self.logit_rows: list[int] = []  # rows asking for logits, per call
        self.max_live_seqs = 0
        self._rows: dict[int, int] = {}
        self._logits: list[ctypes.Array] = []  # kept alive while the backend reads them
        self.freed: list[str] = []
        if seq_rm_api == "memory":
            self.llama_get_memory = lambda ctx: ("memory", ctx)
            self.llama_memory_seq_rm = lambda memory, seq, p0, p1: self._seq_rm(seq, p0, p1)
        elif seq_rm_api == "kv_self":
            self.llama_kv_self_seq_rm = lambda ctx, seq, p0, p1: self._seq_rm(seq, p0, p1)
        else:
            self.llama_kv_cache_seq_rm = lambda ctx, seq, p0, p1: self._seq_rm(seq, p0, p1)

    def _seq_rm(self, seq: int, p0: int, p1: int) -> None:
        assert (p0, p1) == (-1, -1), "the whole sequence is dropped"
        self.kv.pop(seq, None)
        self.removed.append(seq)
        self.events.append(("drop", seq))

    def llama_decode(self, ctx, batch: FakeBatch) -> int:  # noqa: ANN001
        assert 0 < batch.n_tokens <= self.n_batch
        self.batch_sizes.append(batch.n_tokens)
        self._rows = {}
        self._logits = []
        for i in range(batch.n_tokens):
            assert batch.n_seq_id[i] == 1
            seq = batch.seq_id[i][0]
            assert 0 <= seq < self.parallel, f"sequence id {seq} beyond n_seq_max"
            cache = self.kv.setdefault(seq, [])
            assert batch.pos[i] == len(cache), f"seq {seq}: position {batch.pos[i]} after {len(cache)} cached tokens"
            if batch.pos[i] == 0:
                self.admitted.append(seq)
                self.events.append(("admit", seq))
            cache.append(batch.token[i])
            if batch.logits[i]:
                self._rows[i] = next_token(cache)
        self.max_live_seqs = max(self.max_live_seqs, len(self.kv))
        self.logit_rows.append(len(self._rows))
        return 0

    def llama_get_logits_ith(self, ctx, i: int):  # noqa: ANN001, ANN201
        assert i in self._rows, f"row {i} asked for logits it did not request"
        logits = (ctypes.c_float * N_VOCAB)()
        logits[self._rows[i]] = 1.0
        self._logits.append(logits)
        return ctypes.cast(logits, ctypes.POINTER(ctypes.c_float))

    # Set-up and tear-down (run_llamacpp).
    def llama_backend_init(self) -> None:
        pass

    def llama_model_load_from_file(self, path: bytes, params) -> str:  # noqa: ANN001
        return "model"

    def llama_model_default_params(self) -> SimpleNamespace:
        return SimpleNamespace()

    def llama_context_default_params(self) -> SimpleNamespace:
        return SimpleNamespace(n_ctx=0, n_batch=0, n_ubatch=0, n_seq_max=1, n_threads=0, n_threads_batch=0)

    def llama_init_from_model(self, model, params) -> str:  # noqa: ANN001
        assert params.n_batch == self.n_batch and params.n_seq_max == self.parallel
        self.context_params = params
        return "ctx"

    def llama_model_get_vocab(self, model) -> str:  # noqa: ANN001
        return "vocab"

    def llama_vocab_n_tokens(self, vocab) -> int:  # noqa: ANN001
        return N_VOCAB

    def llama_batch_init(self, n_batch: int, embd: int, n_seq_max: int) -> FakeBatch:
        return FakeBatch(n_batch, n_seq_max)

    def llama_batch_free(self, batch) -> None:  # noqa: ANN001
        self.freed.append("batch")

    def llama_free(self, ctx) -> None:  # noqa: ANN001
        self.freed.append("ctx")

    def llama_model_free(self, model) -> None:  # noqa: ANN001
        self.freed.append("model")


def make_requests(n: int, seed: int = 0, max_prompt: int = 20, max_output: int = 6) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(N_VOCAB) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_output))
        for _ in range(n)
    ]


@pytest.mark.parametrize("seq_rm_api", ["memory", "kv_self", "kv_cache"])
def test_sequences_get_their_tokens_slots_are_reused_and_kv_cleared(seq_rm_api):
    parallel, n_batch = 3, 8
    requests = make_requests(9)
    api = FakeLlamaCpp(n_batch, parallel, seq_rm_api)
    outputs = decode_all(api, "ctx", FakeBatch(n_batch, parallel), requests, parallel, n_batch, N_VOCAB)
    # Every request got exactly its length, and the model's tokens for its own sequence.
    assert [len(o) for o in outputs] == [r.output_len for r in requests]
    assert outputs == [expected_output(r) for r in requests]
    # Nine requests went through three slots: each slot served several, one at a time.
    assert len(api.admitted) == len(requests)
    assert set(api.admitted) == {0, 1, 2} and api.max_live_seqs <= parallel
    # Each finished request's KV was dropped (the position checks saw every reused slot
    # start empty), and nothing is left behind.
    assert sorted(api.removed) == sorted(api.admitted) and api.kv == {}
    # Prompts longer than a batch were fed in chunks of at most n_batch tokens.
    assert max(api.batch_sizes) == n_batch


def test_a_slot_is_taken_again_only_after_its_kv_is_dropped():
    requests = [BenchRequest([1, 2, 3], 5), BenchRequest([4], 1), BenchRequest([5, 6], 2), BenchRequest([7], 3)]
    api = FakeLlamaCpp(n_batch=16, parallel=2)
    outputs = decode_all(api, "ctx", FakeBatch(16, 2), requests, 2, 16, N_VOCAB)
    assert outputs == [expected_output(r) for r in requests]
    # Slot 0 takes request 0 (five tokens), slot 1 request 1 (one token: done with its
    # prompt), then request 2, then 3; each is dropped before the slot is taken again.
    # (Decoding rows go first in a call, so request 1's prompt is fed before request 0's.)
    assert api.events == [
        ("admit", 1), ("admit", 0),  # call 1: both prompts
        ("drop", 1), ("admit", 1),  # request 1 done, request 2 in
        ("drop", 1), ("admit", 1),  # request 2 done (2 tokens), request 3 in
        ("drop", 0), ("drop", 1),  # request 0 done (5 tokens), then request 3 (3 tokens)
    ]
    assert api.kv == {}


def test_decoding_rows_come_first_and_only_last_prompt_rows_ask_for_logits():
    # One long prompt arrives while another sequence decodes: the decode token must not
    # wait behind the prompt, and a prompt split over calls asks for logits only at its end.
    requests = [BenchRequest([1], 6), BenchRequest(list(range(10)), 2)]
    api = FakeLlamaCpp(n_batch=4, parallel=2)
    outputs = decode_all(api, "ctx", FakeBatch(4, 2), requests, 2, 4, N_VOCAB)
    assert outputs == [expected_output(r) for r in requests]
    # Request 0 decodes in every call (1 row) while request 1's prompt fills the rest in
    # chunks of 3, 3, 3, 1; only the chunk ending the prompt asks for logits.
    assert api.batch_sizes == [4, 4, 4, 2, 2, 1]
    assert api.logit_rows == [1, 1, 1, 2, 2, 1]


def test_run_llamacpp_with_the_stand_in():
    requests = make_requests(6, seed=3)
    api = FakeLlamaCpp(n_batch=8, parallel=4)
    result = run_llamacpp(requests, "model.gguf", parallel=4, n_batch=8, repeats=2, llama_cpp=api)
    assert result.backend == "llamacpp"
    assert result.output_tokens == sum(r.output_len for r in requests)
    assert result.prompt_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert result.output_token_ids == [expected_output(r) for r in requests]
    assert len(result.settings["elapsed_runs_s"]) == 2
    # Room for every slot's longest sequence; warm-up (2 requests) + 2 runs of 6.
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    assert api.context_params.n_ctx == 4 * longest
    assert len(api.admitted) == 2 + 2 * 6 and api.kv == {}
    assert api.freed == ["batch", "ctx", "model"]


def test_a_failed_decode_is_an_error():
    api = FakeLlamaCpp(n_batch=8, parallel=2)
    api.llama_decode = lambda ctx, batch: 1
    with pytest.raises(PagellmError, match="llama_decode failed"):
        run_llamacpp(make_requests(2), "model.gguf", parallel=2, n_batch=8, llama_cpp=api)
    assert api.freed == ["batch", "ctx", "model"]
