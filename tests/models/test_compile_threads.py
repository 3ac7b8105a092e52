"""Compiled DiTs on several threads (the server's workers, one model per GPU): a compiled call on one thread runs,
and gives the eager output, while another thread's torch.compile traces. The overlap is made certain by a
custom op whose fake kernel, run by the AOT trace, waits for the other thread's call.

Which thread sees torch.fx's tracing flag differs between torch versions: torch 2.11 (the GPU image) raises on the
other thread; torch 2.13 also sets its process-wide compiling flag there, which hides the tracing flag. The test
pins the 2.11 reading (the tracing flag seen from every thread but the tracing one) so that it shows the hazard
with any torch."""
import threading

import torch

from fastwan.attention import AttentionDispatch
from fastwan.models import load_transformer

DEFAULTS = {"error_on_nested_fx_trace": True, "force_compile_during_fx_trace": False}


@torch.library.custom_op("fastwan_test::hold_trace", mutates_args=())
def hold_trace(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


HOLD = {}  # the events of the scenario running now: "tracing" (set by the fake kernel), "called" (other thread done)


@hold_trace.register_fake
def _(x):
    if torch.fx._symbolic_trace._is_fx_tracing_flag:  # the AOT stage's trace, not dynamo's fake run
        HOLD["tracing"].set()
        HOLD["called"].wait(timeout=60)
    return torch.empty_like(x)


def _while_another_thread_compiles(call):
    """Runs ``call`` on this thread while another thread's torch.compile is inside its AOT trace -> (result,
    exception)."""
    HOLD.update(tracing=threading.Event(), called=threading.Event())
    scope = {"hold_trace": hold_trace}
    exec("def traced(x):\n    return hold_trace(x) * 2", scope)  # a new code object: compiled afresh each time
    compiled = torch.compile(scope["traced"], backend="aot_eager", fullgraph=True)
    other = HOLD["thread"] = threading.Thread(target=compiled, args=(torch.randn(4),))
    other.start()
    try:
        assert HOLD["tracing"].wait(timeout=60), "the other thread's compilation never reached its AOT trace"
        try:
            return call(), None
        except RuntimeError as exc:
            return None, exc
    finally:
        HOLD["called"].set()
        other.join(timeout=60)


def _traced_elsewhere() -> bool:
    return torch.fx._symbolic_trace._is_fx_tracing_flag and threading.current_thread() is not HOLD.get("thread")


def test_compiled_dit_runs_while_another_thread_compiles(tiny_ckpts, monkeypatch):
    monkeypatch.setattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", _traced_elsewhere)  # before any compile
    torch._dynamo.reset()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(tiny_ckpts["wan2.1"] / "transformer", dtype=torch.float32, device="cpu", attention=attn)
    x, t, text = torch.randn(1, 16, 3, 8, 8), torch.tensor([700.0]), torch.randn(1, 9, 32)
    with torch.no_grad(), torch._dynamo.config.patch(**DEFAULTS):
        want = model(x, t, text)
        # torch's defaults: the hazard is real (another thread's compiled call raises)
        plain = torch.compile(lambda v: v + 1, backend="aot_eager")
        plain(torch.randn(3))
        _, exc = _while_another_thread_compiles(lambda: plain(torch.randn(3)))
        assert exc is not None and "symbolically trace" in str(exc)

        model.compile_blocks(fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(model(x, t, text), want, rtol=1e-5, atol=1e-5)  # compiled, warm
        got, exc = _while_another_thread_compiles(lambda: model(x, t, text))
    assert exc is None, exc
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
