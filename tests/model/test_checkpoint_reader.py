"""model/checkpoint/ reads a checkpoint's metadata with no torch (docs/architecture.md):
the same configs as the loader, in a process where `import torch` fails; and its
architecture tables name exactly the classes model/registry.py runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from gguf_models import write_gguf_from_hf
from hf_models import make_tiny_hf_checkpoint

from pagellm.model.checkpoint import architectures, load_model_config
from pagellm.model.loader import ModelSource
from pagellm.model.registry import MODEL_CLASSES, model_class

REPO_ROOT = Path(__file__).resolve().parents[2]

READ_WITHOUT_TORCH = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` now raises
    from pagellm.model.checkpoint import ModelSource, load_model_config, load_tokenizer, resolve_model_source
    for kind, path in ((sys.argv[1], sys.argv[2]), (sys.argv[3], sys.argv[4])):
        source = ModelSource(kind, __import__("pathlib").Path(path), "m")
        config = load_model_config(source)
        print(kind, config.architecture, config.num_hidden_layers, config.has_lm_head)
    source = resolve_model_source(sys.argv[2])
    tokenizer = load_tokenizer(source, load_model_config(source))
    print("tokens", tokenizer.encode("a b"))
    heavy = sorted(m for m in ("torch", "triton", "transformers", "pagellm.model.llama") if sys.modules.get(m))
    print("heavy", heavy)
    """
)


def test_configs_read_with_torch_blocked(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen3")
    cfg = json.loads((folder / "config.json").read_text())
    gguf_file = write_gguf_from_hf(folder, tmp_path / "m.gguf", cfg, arch="qwen3")
    result = subprocess.run(
        [sys.executable, "-c", READ_WITHOUT_TORCH, "hf", str(folder), "gguf", str(gguf_file)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # The same configs as read in this process (torch loaded), field for field.
    hf_config = load_model_config(ModelSource("hf", folder, "m"))
    gguf_config = load_model_config(ModelSource("gguf", gguf_file, "m"))
    assert lines[0] == f"hf Qwen3ForCausalLM {hf_config.num_hidden_layers} True"
    assert lines[1] == f"gguf qwen3 {gguf_config.num_hidden_layers} True"
    assert lines[2].startswith("tokens [") and lines[2] != "tokens []"
    assert lines[3] == "heavy []"


def test_architecture_tables_match_the_registry():
    assert set(architectures.SUPPORTED_HF_ARCHITECTURES) == set(MODEL_CLASSES)
    targets = [
        *architectures.ARCHITECTURE_BY_MODEL_TYPE.values(),
        *architectures.ARCHITECTURE_BY_GGUF_NAME.values(),
        *architectures.BASE_MODEL_ARCHITECTURES.values(),
        *architectures.CLASSIFIER_ARCHITECTURES.values(),
    ]
    assert set(targets) <= set(MODEL_CLASSES)
    assert architectures.hf_architecture("llama", num_experts=8) == "MixtralForCausalLM"
    assert architectures.hf_architecture("qwen3moe") == "Qwen3MoeForCausalLM"


def test_every_gguf_name_has_a_class():
    from pagellm.config.model import ModelConfig

    for gguf_name, hf_name in architectures.ARCHITECTURE_BY_GGUF_NAME.items():
        config = ModelConfig(architecture=gguf_name, vocab_size=8, hidden_size=8, intermediate_size=8,
                             num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6)  # fmt: skip
        assert model_class(config) is MODEL_CLASSES[hf_name]
