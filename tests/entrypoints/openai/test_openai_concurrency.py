"""Many simultaneous streaming clients share one server: every one gets its whole answer."""

from __future__ import annotations

import asyncio

from serve_helpers import API_KEY

from pagellm import SamplingParams

NUM_CLIENTS = 40
MAX_TOKENS = 32


def prompts() -> list[str]:
    # Different lengths and contents, so that requests sit at different positions.
    return [f"Request {i}: " + "xyz" * (i % 7) for i in range(NUM_CLIENTS)]


async def stream_all(base_url: str, model: str) -> list[tuple[str, str | None, int]]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=300) as client:

        async def one(prompt: str, chat: bool) -> tuple[str, str | None, int]:
            if chat:
                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                pieces, finish, num_chunks = [], None, 0
                async for chunk in stream:
                    num_chunks += 1
                    if chunk.choices:
                        pieces.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                return "".join(pieces), finish, num_chunks
            stream = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            pieces, finish, num_chunks = [], None, 0
            async for chunk in stream:
                num_chunks += 1
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            return "".join(pieces), finish, num_chunks

        jobs = [one(p, chat=i % 4 == 3) for i, p in enumerate(prompts())]
        return await asyncio.gather(*jobs)


def test_many_streaming_clients_get_offline_answers(server, model_name, offline_llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokenizer = offline_llm.get_tokenizer()
    references = []
    for i, prompt in enumerate(prompts()):
        if i % 4 == 3:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            references.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            references.append(prompt)
    expected = [o.outputs[0].text for o in offline_llm.generate(references, params, use_tqdm=False)]

    results = asyncio.run(stream_all(server.api_url, model_name))

    assert [text for text, _, _ in results] == expected
    assert all(finish == "length" for _, finish, _ in results)
    # Streamed: every client got its answer in pieces, not in one final chunk.
    assert all(num_chunks > 2 for _, _, num_chunks in results)
