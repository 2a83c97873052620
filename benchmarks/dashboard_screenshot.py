"""A screenshot of the live dashboard under load, for docs/images/dashboard.png.

Starts `pagellm serve` on the embedded model with a small KV cache (so that the block
map is busy), runs streaming completion requests that share a prefix, waits until the
page has several seconds of history, and has headless Chromium take the picture.

    python benchmarks/dashboard_screenshot.py [--output docs/images/dashboard.png]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

READY_MARK = "pagellm is ready: model "


def start_server(port: int, num_blocks: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", str(port),
        "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", "2048",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if READY_MARK in line:
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process
    raise RuntimeError("the server did not start")


def load(base_url: str, stop: threading.Event, index: int) -> None:
    import openai

    shared = "You are a careful assistant. Answer in detail, with examples. " * 4
    with openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        while not stop.is_set():
            stream = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=shared + f"Question {index}: explain how a paged KV cache works.",
                max_tokens=200 + 60 * index,
                temperature=0.8,
                stream=True,
            )
            for _ in stream:
                if stop.is_set():
                    break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="docs/images/dashboard.png")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--warmup-s", type=float, default=25.0)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("headless Chromium is needed (chromium on PATH)")
    base_url = f"http://127.0.0.1:{args.port}"
    server = start_server(args.port, args.num_blocks)
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(base_url, stop, i), daemon=True) for i in range(args.clients)]
    try:
        for thread in threads:
            thread.start()
            time.sleep(0.5)
        time.sleep(args.warmup_s)
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}", "--window-size=1280,1000", "--virtual-time-budget=6000",
                    "--hide-scrollbars", f"--screenshot={output.resolve()}", base_url + "/dashboard/",
                ],  # fmt: skip
                capture_output=True,
                timeout=180,
                check=True,
            )
        print(f"wrote {output}")
    finally:
        stop.set()
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
