"""``fastwan serve`` against the same request through the Python API, on one GPU and on several.

Phases (each appends to the JSON given by --out):
  make    write a random checkpoint at the real Wan2.1 shapes (--size) to --ckpt (benchmarks.checkpoints)
  direct  VideoGenerator.load then generate(request): one warm-up call, then --repeats timed calls (the call to the
          mp4 on disk)
  server  ``fastwan serve --gpus G`` (one worker and one model per GPU) with the same load options: one warm-up
          job per worker, then --repeats single jobs one after another, each timed from its create to its
          ``completed`` event (the client's view, through the SSE stream), then --queue jobs created at once: the
          wall time from the first create to the last completion, jobs per minute, and each worker's idle gaps
          between two jobs (the server log's times: the end of one job's GPU work, its completion less its file's
          seconds, to the next job's start on that GPU)
The request is the same in both: 832x480, 81 frames, --steps steps, the preset's guidance, a fixed seed.

  python -m benchmarks.serve_bench --phase make,direct,server --ckpt /tmp/wan13b --compile --gpus 0 --repeats 3
  python -m benchmarks.serve_bench --phase server --ckpt /tmp/wan13b --gpus 0,1,2,3 --repeats 0 --queue 8
  python -m benchmarks.serve_bench --smoke      # CI: tiny checkpoint on the CPU, 2 steps, 1 repeat, 2 queued
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from benchmarks.checkpoints import make_checkpoint
from benchmarks.harness import NEG, PROMPT, SMOKE_DIR, add_device, add_smoke, command, log, output, parse_args, versions

PHASES = ("make", "direct", "server")
SEED = 7
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) fastwan\.serve INFO: video (video_[0-9a-f]+): "
                      r"(in_progress on (\S+)|completed(?: \(.*steps ([\d.]+) s.*file ([\d.]+) s\))?)")


def request_fields(video: tuple[int, int, int], steps: int) -> dict:
    frames, height, width = video
    return {"prompt": PROMPT, "negative_prompt": NEG, "width": width, "height": height, "num_frames": frames,
            "num_inference_steps": steps, "seed": SEED}


def phase_direct(args, video) -> dict:
    from fastwan.pipelines.generator import VideoGenerator
    from fastwan.pipelines.load_options import LoadOptions
    from fastwan.pipelines.params import GenerationRequest

    gen = VideoGenerator.load(LoadOptions(model=str(args.ckpt), device=args.device,
                                          enable_torch_compile=args.compile))
    folder = Path(tempfile.mkdtemp(prefix="serve-bench-direct-"))
    times, steps = [], []
    for k in range(1 + args.repeats):
        request = GenerationRequest(**request_fields(video, args.steps), output_path=str(folder / f"{k}.mp4"))
        start = time.perf_counter()
        result = gen.generate(request)
        times.append(time.perf_counter() - start)
        steps.append(result.timings["denoising"])
        log(f"direct call {k}: {times[-1]:.2f} s, steps {steps[-1]:.2f} s{' (warm-up)' if k == 0 else ''}")
    timed = times[1:]
    return {"device": str(gen.device), "warmup_s": times[0], "runs_s": timed, "steps_s": steps[1:],
            "median_s": statistics.median(timed) if timed else None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def log_tail(path: Path, lines: int = 40) -> str:
    """The server log's last ``lines`` lines, its progress bars and access lines left out (what a failed job's
    error carries)."""
    text = path.read_bytes().decode(errors="replace") if path.exists() else ""  # a bar's \r kept
    kept = [line for line in text.split("\n") if line and "\r" not in line
            and not line.startswith("INFO:     127.0.0.1")]
    return "\n".join(kept[-lines:])


def _until_done(url: str, video_id: str, log_path: Path | None = None) -> dict:
    """Read the video's SSE stream until its last event; that event's video object. A job that does not complete
    raises with the server log's tail (``log_path``)."""
    last = None
    with urllib.request.urlopen(f"{url}/v1/videos/{video_id}/events", timeout=3600) as answer:
        for line in answer:
            if line.startswith(b"data: "):
                last = json.loads(line[6:])
    if last is None or last["status"] != "completed":
        tail = "" if log_path is None else f"\nthe server log's last lines:\n{log_tail(log_path)}"
        raise RuntimeError(f"video {video_id} did not complete: {last}{tail}")
    return last


def _log_times(text: str) -> dict[str, dict]:
    """Per job: its start and completion (epoch seconds) and its device, from the server log."""
    jobs: dict[str, dict] = {}
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if m:
            when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            job = jobs.setdefault(m.group(2), {})
            if m.group(4):
                job.update(start=when, device=m.group(4))
            else:
                job["done"] = when
                if m.group(5):
                    job.update(steps_s=float(m.group(5)), file_s=float(m.group(6)))
    return jobs


def idle_gaps(jobs: dict[str, dict], ids: list[str]) -> dict[str, list[float]]:
    """Per device: the seconds it waits between two of ``ids`` there, from the end of one job's device work (its
    completion less the seconds its file took, which the worker writes while the next job runs) to the next job's
    start; 0 when the next job started before that."""
    by_device: dict[str, list[dict]] = {}
    for video_id in ids:
        by_device.setdefault(jobs[video_id]["device"], []).append(jobs[video_id])
    return {device: [max(0.0, b["start"] - (a["done"] - a.get("file_s", 0.0))) for a, b in zip(runs, runs[1:])]
            for device, runs in ((d, sorted(r, key=lambda j: j["start"])) for d, r in by_device.items())}


def phase_server(args, video) -> dict:
    port, data = _free_port(), Path(tempfile.mkdtemp(prefix="serve-bench-data-"))
    log_path = data.parent / f"{data.name}.log"
    argv = [sys.executable, "-m", "fastwan", "serve", "--model", str(args.ckpt), "--port", str(port), "--data-dir",
            str(data), *(["--gpus", args.gpus] if args.gpus else ["--device", args.device]),
            *(["--compile"] if args.compile else [])]
    log(" ".join(argv))
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as sink:
        server = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited:\n{log_path.read_text()}")
            try:
                _call(url + "/ready")
                break
            except OSError:
                time.sleep(1)
        workers = len(args.gpus.split(",")) if args.gpus else 1
        body = request_fields(video, args.steps)
        warm = [_call(url + "/v1/videos", body)["id"] for _ in range(workers)]
        for video_id in warm:
            _until_done(url, video_id, log_path)
        log(f"server warm-up: {workers} job(s) done")
        singles = []
        for k in range(args.repeats):
            start = time.time()
            _until_done(url, _call(url + "/v1/videos", body)["id"], log_path)
            singles.append(time.time() - start)
            log(f"server single job {k}: {singles[-1]:.2f} s")
        first = time.time()
        queued = [_call(url + "/v1/videos", body)["id"] for _ in range(args.queue)]
        for video_id in queued:
            _until_done(url, video_id, log_path)
        time.sleep(0.5)  # the last log line is written
        jobs = _log_times(log_path.read_text())
        wall = max(jobs[v]["done"] for v in queued) - first if queued else None
        gaps = idle_gaps(jobs, queued) if queued else {}
        result = {"gpus": args.gpus or args.device, "workers": workers, "singles_s": singles,
                  "single_median_s": statistics.median(singles) if singles else None, "queue": args.queue,
                  "queue_wall_s": wall, "jobs_per_min": None if not wall else 60 * args.queue / wall,
                  "job_s": [jobs[v]["done"] - jobs[v]["start"] for v in queued],
                  "job_steps_s": [jobs[v].get("steps_s") for v in queued],
                  "job_device": [jobs[v]["device"] for v in queued], "idle_gaps_s": gaps,
                  "max_gap_s": max((g for gs in gaps.values() for g in gs), default=None)}
        log(f"server queue: {args.queue} jobs in {wall:.2f} s" if wall else "server: no queue")
        return result
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="direct,server", help=f"comma-separated: {', '.join(PHASES)}")
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/wan13b"))
    p.add_argument("--size", default="1.3b", choices=("1.3b", "14b", "tiny"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3, help="timed calls / single jobs after the warm-up")
    p.add_argument("--queue", type=int, default=4, help="jobs created at once after the single jobs")
    p.add_argument("--gpus", default=None, help="the server's --gpus (default: one worker on --device)")
    p.add_argument("--out", default="serve_bench.json")
    add_device(p, compile_default=False)
    add_smoke(p, size="tiny", steps=2, repeats=1, queue=2, ckpt=SMOKE_DIR / "serve-tiny",
              phase="make,direct,server")
    args = parse_args(p, argv)
    phases = [x for x in args.phase.split(",") if x]
    unknown = [x for x in phases if x not in PHASES]
    if unknown:
        p.error(f"--phase {','.join(unknown)}: unknown; use some of {', '.join(PHASES)}")
    from benchmarks.harness import DIT_SIZES

    video = DIT_SIZES[args.size][1]
    res: dict = {"command": command("python -m benchmarks.serve_bench", argv), "versions": versions(),
                 "video": video, "steps": args.steps}
    if "make" in phases:
        make_checkpoint(args.ckpt, args.size, device=args.device)
    if "direct" in phases:
        res["direct"] = phase_direct(args, video)
    if "server" in phases:
        res["server"] = phase_server(args, video)
    path = output(args.out)
    previous = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps([*previous, res], indent=1))
    d, s = res.get("direct"), res.get("server")
    log("| path | median s | runs s | queue: jobs, wall s, jobs/min, max idle gap s |")
    log("|---|---|---|---|")
    if d:
        log(f"| generate (Python API) | {d['median_s']:.2f} | {', '.join(f'{t:.2f}' for t in d['runs_s'])} | |")
    if s:
        median = "" if s["single_median_s"] is None else f"{s['single_median_s']:.2f}"
        gap = "" if s["max_gap_s"] is None else f"{s['max_gap_s']:.3f}"
        queue = "" if not s["queue_wall_s"] else (f"{s['queue']}, {s['queue_wall_s']:.2f}, "
                                                  f"{s['jobs_per_min']:.2f}, {gap}")
        log(f"| fastwan serve ({s['gpus']}) | {median} | {', '.join(f'{t:.2f}' for t in s['singles_s'])} | {queue} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
