"""serve_bench's diagnostics: a job that does not complete raises with the server log's tail, the progress bars and
the access log left out (the log of a real server, written by the server's own logger format)."""
from benchmarks.serve_bench import log_tail


def test_log_tail_keeps_the_last_lines_without_progress_bars(tmp_path):
    log = tmp_path / "server.log"
    lines = [f"2026-11-28 18:09:{k:02d},000 fastwan.serve INFO: line {k}" for k in range(50)]
    noise = ["\rdenoising:  2%|▏         | 1/50 [00:15<12:26, 15.23s/it]\rdenoising:  4%",
             'INFO:     127.0.0.1:44958 - "GET /ready HTTP/1.1" 200 OK']
    log.write_text("\n".join(lines[:47] + noise + lines[47:] + ["Fatal Python error: Aborted"]) + "\n")
    tail = log_tail(log, lines=6).splitlines()
    assert tail == [*lines[45:], "Fatal Python error: Aborted"]
    assert log_tail(tmp_path / "missing.log") == ""
