"""Argument checks shared by the whole library: bad input gets a ValueError / TypeError that names
the argument, what was expected and what came, before any work is done.

Numbers: Python's and NumPy's scalars are accepted alike (``np.int64(3)`` is an int,
``np.float32(0.5)`` a float, ``np.bool_(True)`` a bool), but a bool is never taken for a number:
``True`` is not a head count.

These checks sit at the library's entry points (a module's ``forward``, ``GPT.generate``, a
constructor). Calls from inside the library, on values the library itself built, skip them.
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MODEL_LIMITS",
    "autocast_on",
    "broadcast_shape",
    "can_read_values",
    "check_attn_mask",
    "check_bool",
    "check_float_tensor",
    "check_length",
    "check_model_logits",
    "check_model_size",
    "check_module_input",
    "check_same_dtype_and_device",
    "finite_real",
    "has_a_token",
    "is_bool",
    "is_int",
    "is_real",
    "non_negative_int",
    "position_window",
    "positive_int",
    "probability",
    "resolve_device",
]


# -- Python values ---------------------------------------------------------------------------
def is_bool(value: object) -> bool:
    """A Python or NumPy bool."""
    return isinstance(value, (bool, np.bool_))


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not is_bool(value)


def is_real(value: object) -> bool:
    """A real number (int or float, Python or NumPy), not a bool."""
    return isinstance(value, numbers.Real) and not is_bool(value)


def positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1, or ValueError "``name`` must be a positive int, got ...\"."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: object) -> int:
    """``value`` as an int >= 0, or ValueError "``name`` must be a non-negative int, got ...\"."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def position_window(name: str, value: object, n: int) -> tuple[int, int]:
    """``value`` as positions ``(start, stop)`` of ``n`` with ``0 <= start < stop <= n``, or ``(0, n)``
    for None; else ValueError naming ``name``."""
    if value is None:
        return 0, n
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(i) for i in value)
    if not ok or not 0 <= value[0] < value[1] <= n:
        raise ValueError(f"{name} must be (start, stop) with 0 <= start < stop <= {n} (the positions), got {value!r}")
    return int(value[0]), int(value[1])


def probability(name: str, value: object) -> float:
    """A dropout-style rate in [0, 1) as a float, or ValueError "``name`` must be a float in [0, 1)\"."""
    if not is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    """``value`` as a bool; TypeError for anything else (``bool("no")`` is True: no truthy stand-ins)."""
    if not is_bool(value):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def has_a_token(logits: Tensor) -> bool:
    """Whether every row of ``logits (..., V)`` has a finite value and no NaN or +inf, in one pass and one
    host sync: a row's maximum is finite exactly then (NaN propagates into it, +inf is it)."""
    return not logits.numel() or bool(torch.isfinite(logits.amax(dim=-1)).all())


def check_model_logits(logits: Tensor) -> None:
    """ValueError unless a model's ``logits (..., V)`` give a token to pick in every row: NaN logits (a
    model with NaN weights) would make greedy argmax return token 0 forever, multinomial fail."""
    if not has_a_token(logits):
        raise ValueError("the model's logits hold NaN or +inf (are its weights finite?): there is no token to pick")


def finite_real(value: object) -> bool:
    """A finite real number (not NaN or infinite), not a bool."""
    return is_real(value) and math.isfinite(value)


# -- Tensors ---------------------------------------------------------------------------------
def check_float_tensor(name: str, t: object, min_rank: int) -> Tensor:
    """``t`` must be a floating-point tensor with at least ``min_rank`` dimensions."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), "
            f"got dtype {t.dtype}; convert it with .float()"
        )
    if t.dim() < min_rank:
        raise ValueError(f"{name} must have at least {min_rank} dimensions, got shape {tuple(t.shape)}")
    return t


def check_same_dtype_and_device(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """``a`` and ``b`` must share dtype (TypeError) and device (ValueError)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} and {name_b} must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{name_a} and {name_b} must be on the same device, got {a.device} and {b.device}")


def can_read_values(t: Tensor) -> bool:
    """Value checks read data: impossible on meta tensors, a graph break under torch.compile."""
    return t.device.type != "meta" and t.numel() > 0 and not torch.compiler.is_compiling()


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """Broadcast shape of ``shapes`` by numpy's rules, or None if they do not broadcast. Plain Python
    on purpose: ``torch.broadcast_shapes`` imports sympy on first use and costs far more per call,
    which shows in token-by-token decoding."""
    out: list[int] = []
    for dims in itertools.zip_longest(*(reversed(s) for s in shapes), fillvalue=1):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(reversed(out))


def check_attn_mask(
    attn_mask: object,
    *,
    device: torch.device,
    dtype: torch.dtype,
    target: tuple[int, ...],
    input_name: str,
    any_float_dtype: bool = False,
    check_values: bool = True,
) -> Tensor:
    """``attn_mask`` must be a bool or float tensor on ``device``, broadcastable to ``target`` (the
    scores' ``(..., L, S)``); a float one must have ``dtype`` (unless ``any_float_dtype``: under
    autocast it is cast later) and, with ``check_values``, hold no NaN or +inf (one host sync)."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be a bool tensor (True = may attend) or a float tensor added to "
            f"the scores, got dtype {attn_mask.dtype}"
        )
    if attn_mask.device != device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but {input_name} is on {device}")
    if attn_mask.is_floating_point() and attn_mask.dtype != dtype and not any_float_dtype:
        raise TypeError(f"a float attn_mask must have the dtype of {input_name} ({dtype}), got {attn_mask.dtype}")
    if broadcast_shape(tuple(attn_mask.shape), tuple(target)) != tuple(target):
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention scores' "
            f"shape {tuple(target)} (..., L, S)"
        )
    if check_values and attn_mask.is_floating_point() and can_read_values(attn_mask):
        # NaN or +inf added to a score makes its whole row NaN; -inf is the one way to mask.
        bad = int((torch.isnan(attn_mask) | (attn_mask == float("inf"))).sum())  # one host sync
        if bad:
            raise ValueError(
                f"a float attn_mask is added to the scores and must not hold NaN or +inf (use -inf to mask a "
                f"position, or a bool mask), got {bad} such entries"
            )
    return attn_mask


def autocast_on(device: torch.device) -> bool:
    """torch.is_autocast_enabled for this device type; False for types autocast does not know (meta)."""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:
        return False


def check_module_input(name: str, x: object, d_in: int, param: Tensor) -> Tensor:
    """``x`` must be a float ``(n, d_in)`` or ``(b, n, d_in)`` tensor on the device of a module's
    parameter ``param``, with its dtype (outside autocast)."""
    check_float_tensor(name, x, 2)
    if x.dim() > 3:
        raise ValueError(f"{name} must have shape (n, d_in) or (b, n, d_in), got {tuple(x.shape)}")
    if x.shape[-1] != d_in:
        raise ValueError(f"{name} must have last dimension d_in={d_in}, got shape {tuple(x.shape)}")
    if x.device != param.device:
        raise ValueError(f"{name} is on {x.device} but the module's parameters are on {param.device}")
    if x.dtype != param.dtype and not autocast_on(x.device):
        raise TypeError(
            f"{name} has dtype {x.dtype} but the module's parameters are {param.dtype}; "
            f"convert one of them (e.g. x.to({param.dtype}) or module.to({x.dtype}))"
        )
    return x


def check_length(n: int, context_length: int) -> None:
    """An input of ``n`` tokens must fit a module built for ``context_length``."""
    if n > context_length:
        raise ValueError(
            f"the input has {n} tokens, more than context_length={context_length}; "
            f"build the module with a larger context_length or feed at most {context_length} tokens"
        )


# -- Model sizes -----------------------------------------------------------------------------
# Sane upper limits of a GPT configuration, checked before anything is built: a hostile config.json
# (n_layers: 1000000) is a clear error, not minutes of building or terabytes allocated. Each is far past
# any published dense model (~130 layers, width 16-20k, vocabularies of 256k, contexts of 128k).
MODEL_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 22,  # 4,194,304 token ids
    "context_length": 1 << 20,  # 1,048,576 positions
    "emb_dim": 1 << 16,  # 65,536
    "n_heads": 1 << 12,  # 4,096
    "n_layers": 512,  # building one block costs milliseconds even on the meta device
    "ff_dim": 1 << 18,  # 262,144
    "parameters": 1 << 40,  # ~1.1e12 parameters: 4.4 TB in float32
}


def check_model_size(
    *,
    vocab_size: int,
    context_length: int,
    emb_dim: int,
    n_heads: int,
    n_layers: int,
    ff_dim: int,
    source: str = "GPTConfig",
) -> int:
    """ValueError naming the field when a GPT's sizes pass :data:`MODEL_LIMITS`; returns the rough
    parameter count ``V*d + T*d + n_layers * (4*d*d + 2*d*ff_dim)`` (embeddings, attention and MLP
    matrices; biases and norms are negligible). ``ff_dim``: the MLP's hidden width actually used.
    Arguments must already be positive ints (this checks only how large they are)."""
    sizes = dict(vocab_size=vocab_size, context_length=context_length, emb_dim=emb_dim, n_heads=n_heads)
    sizes.update(n_layers=n_layers, ff_dim=ff_dim)
    for name, value in sizes.items():
        if value > MODEL_LIMITS[name]:
            raise ValueError(
                f"{source}: {name}={value} is past attnlab's limit of {MODEL_LIMITS[name]:,} "
                "(a damaged or hand-edited configuration?)"
            )
    d = emb_dim
    n = vocab_size * d + context_length * d + n_layers * (4 * d * d + 2 * d * ff_dim)
    if n > MODEL_LIMITS["parameters"]:
        raise ValueError(
            f"{source}: these sizes make a model of ~{n:.3g} parameters, past attnlab's limit of "
            f"{MODEL_LIMITS['parameters']:.3g} (a damaged or hand-edited configuration?)"
        )
    return n


def check_float_dtype(name: str, dtype: object) -> None:
    """``dtype`` is None or a floating-point ``torch.dtype``, else an error naming the argument ``name``
    (torch's own comes later, from deep inside an initialiser)."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"{name} must be None or a floating-point torch.dtype, got {dtype!r}")


# -- Devices ---------------------------------------------------------------------------------
def check_device(name: str, value: object) -> torch.device | None:
    """``value`` (None, a device's name or a ``torch.device``) as a device this machine has, or an error
    naming the argument ``name``: checked before a model is read, not after (torch's own error is an
    AssertionError about its build)."""
    if value is None:
        return None
    if not isinstance(value, (str, torch.device)) and not is_int(value):
        raise TypeError(f"{name} must be a device name, a torch.device or an index, got {type(value).__name__}")
    try:
        dev = torch.device(value if not is_int(value) else int(value))
    except RuntimeError:
        if is_int(value):
            raise ValueError(f"{name}={value!r} is an accelerator's index, and this machine has none") from None
        raise ValueError(f"{name}={value!r} is not a device name (try cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r}: CUDA is not available in this torch build or on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name}={value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}={value!r}: MPS is not available on this machine")
    return dev


def resolve_device(name: Any, local_rank: int = 0) -> torch.device:
    """A ``--device`` value as a device: ``auto`` -> ``cuda`` (this process's GPU under torchrun),
    else ``mps``, else ``cpu``; ``cuda`` / ``cuda:1`` / ``mps`` / ``cpu`` only where they exist."""
    if not isinstance(name, str):
        raise ValueError(f"--device must be a string, got {name!r}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = check_device("--device", name)  # a name, and a device this machine has
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {name}: attnlab runs on cpu, cuda or mps, got {dev.type!r}")
    return dev
