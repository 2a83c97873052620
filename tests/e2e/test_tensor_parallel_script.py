"""Tensor parallelism from a plain script: no `if __name__ == "__main__":` guard.

The ranks start through pagellm's own entry point (executor/rank_process.py), so the
script's body runs once, in its own process only, and its greedy tokens equal TP=1's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from hf_models import make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM

REPO_ROOT = Path(__file__).resolve().parents[2]
MARK = "the script's body ran"

# What a user writes: top-level code only. It never shuts the LLM down either: the
# ranks end with the interpreter.
SCRIPT = """\
import json
from pagellm import LLM, SamplingParams

print({mark!r}, flush=True)
llm = LLM(model={model!r}, tensor_parallel_size={tp}, dtype="float32", max_model_len=256,
          max_num_batched_tokens=16, num_gpu_blocks_override=64)
params = SamplingParams(temperature=0.0, max_tokens={new_tokens}, ignore_eos=True)
outputs = llm.generate({prompts!r}, params, use_tqdm=False)
print(json.dumps([output.outputs[0].token_ids for output in outputs]))
"""


def run_plain_script(tmp_path: Path, model: str, tp: int, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT.format(mark=MARK, model=model, tp=tp, prompts=prompts, new_tokens=new_tokens))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stdout.splitlines()
    assert lines.count(MARK) == 1, result.stdout  # no rank ran the script's body again
    return json.loads(lines[-1])


def test_tp2_from_a_script_without_a_main_guard_equals_tp1(tmp_path):
    folder = str(make_tiny_hf_checkpoint(tmp_path / "tiny", seed=5))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], list(range(3, 40))]
    with LLM(folder, tensor_parallel_size=1, dtype="float32", max_model_len=256, num_gpu_blocks_override=64) as llm:
        expected = pagellm_greedy(llm, prompts, 12)
    assert run_plain_script(tmp_path, folder, 2, prompts, 12) == expected



def test_smollm2_tp3_from_a_script_equals_hf(tmp_path, smollm2_path, smollm2_hf):
    """The real model, 9 heads and 3 KV heads over 3 ranks in float32, from a guard-less
    script: HF transformers' greedy tokens on the same GGUF (which TP=1 equals too)."""
    from pagellm.model.loader import load_model_config, load_tokenizer, resolve_model_source

    source = resolve_model_source(str(smollm2_path))
    tokenizer = load_tokenizer(source, load_model_config(source))
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    outputs = run_plain_script(tmp_path, str(smollm2_path), 3, prompts, 12)
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy(smollm2_hf, prompt, 12)
