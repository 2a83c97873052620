"""The embedded SmolLM2 GGUF: pagellm's greedy tokens equal HF transformers' on the same file."""

import pytest
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM

NEW_TOKENS = 40
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
CHAT = ["What is 2+2?", "Write a haiku about the sea.", "Name three primary colors."]


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    return LLM(str(smollm2_path), max_model_len=2048)


def test_greedy_tokens_equal_transformers(smollm2_llm, smollm2_hf):
    tokenizer = smollm2_llm.get_tokenizer()
    plain = [tokenizer.encode(p) for p in PLAIN]
    chat = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in CHAT
    ]
    eos = tokenizer.eos_token_ids
    # Plain prompts run the full length (EOS ignored on both sides); chat prompts stop at EOS.
    for prompt, tokens in zip(plain, pagellm_greedy(smollm2_llm, plain, NEW_TOKENS)):
        assert len(tokens) == NEW_TOKENS
        assert tokens == hf_greedy(smollm2_hf, prompt, NEW_TOKENS)
    chat_out = pagellm_greedy(smollm2_llm, chat, NEW_TOKENS, stop_at_eos=True)
    for prompt, tokens in zip(chat, chat_out):
        assert tokens == hf_greedy(smollm2_hf, prompt, NEW_TOKENS, eos)
    assert "4" in tokenizer.decode(chat_out[0])


def test_real_model_under_chunking_preemption_and_prefix_hits(smollm2_path, smollm2_hf):
    """Chat prompts share SmolLM2's default system prompt: prefix hits; a small cache and a
    16-token budget force chunked prefill and preemption. Tokens still equal HF's."""
    llm = LLM(
        str(smollm2_path),
        max_model_len=128,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=12,
        max_num_seqs=4,
    )
    tokenizer = llm.get_tokenizer()
    questions = CHAT + ["Say hello.", "What is the boiling point of water?"]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in questions
    ]
    outputs = pagellm_greedy(llm, prompts, 24)
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(smollm2_hf, prompt, 24)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    assert stats.num_prefix_hit_tokens > 0
