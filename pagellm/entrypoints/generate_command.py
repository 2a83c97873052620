"""Entrypoints stage: `pagellm generate`, one prompt in, text out, through the engine."""

from __future__ import annotations

import argparse

from pagellm.engine.llm_engine import LLMEngine
from pagellm.config.cli_args import engine_args_from_namespace
from pagellm.sampling_params import SamplingParams


def run_generate(args: argparse.Namespace) -> None:
    # Validate the cheap things before loading a model.
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    engine = LLMEngine.from_engine_args(engine_args_from_namespace(args))
    tokenizer = engine.tokenizer
    if args.chat:
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": args.prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt: str | list[int] = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt = args.prompt
    request_id = engine.add_request(None, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    assert final is not None
    print(final.outputs[0].text)
