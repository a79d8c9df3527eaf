"""Peak memory and time of the trainer's logprob forward and backward, with the output head
run by chunks of positions (`services/trainer/grpo.py`, `token_logprobs`) and over the whole
batch at once, side by side, on a real-shaped checkpoint (`robustrl model init --like`).

Each (batch, path) runs in a fresh process that loads the model in fp32 (the trainer's master
weights), takes the forward and backward, and reports its peak resident memory above the
loaded model's, and the median seconds of `--repeats` passes. On a CPU the peak is the
process's; on a GPU (`--device cuda`) torch's own peak.

    python benchmarks/logprob_memory.py --model .robustrl/models/like-qwen \
        --rows 8,32 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(model_dir: str, rows: int, tokens: int, chunk: int, device: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.grpo import token_logprobs

    torch.set_num_threads(1)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device)
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 - nn.Module types it as a Module
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens), generator=generator).to(device)
    mask = torch.ones_like(ids)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        logp = token_logprobs(model, ids, mask, 1.0, chunk=chunk)
        logp.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    return {"peak_mib": round(peak, 1), "seconds": round(statistics.median(seconds), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint (`model init --like`)")
    parser.add_argument("--rows", default="8,32", help="sequences per batch, comma-separated")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--chunk", type=int, default=1024, help="positions per chunk")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        rows, tokens, chunk = args.one
        result = one(args.model, rows, tokens, chunk, args.device, args.repeats)
        print(json.dumps(result))
        return 0
    print(f"{'rows':>5} {'tokens':>6} {'path':>8} {'peak MiB':>9} {'s':>7}")
    table = {}
    for rows in (int(r) for r in args.rows.split(",")):
        for path, chunk in (("chunked", args.chunk), ("whole", 0)):
            argv_one = [sys.executable, __file__, "--model", args.model, "--device", args.device]
            argv_one += ["--repeats", str(args.repeats), "--one", str(rows), str(args.tokens)]
            done = subprocess.run(
                [*argv_one, str(chunk)],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parents[1],
            )
            if done.returncode:
                print(f"{rows:>5} {args.tokens:>6} {path:>8} failed: {done.stderr[-300:]}")
                continue
            result = json.loads(done.stdout.splitlines()[-1])
            table[(rows, path)] = result
            print(
                f"{rows:>5} {args.tokens:>6} {path:>8} {result['peak_mib']:>9.1f} "
                f"{result['seconds']:>7.3f}",
                flush=True,
            )
    for rows in sorted({r for r, _ in table}):
        if (rows, "chunked") in table and (rows, "whole") in table:
            c, w = table[(rows, "chunked")], table[(rows, "whole")]
            print(
                f"rows {rows}: chunked/whole peak {c['peak_mib'] / max(w['peak_mib'], 1e-9):.2f}"
                f", time {c['seconds'] / w['seconds']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
