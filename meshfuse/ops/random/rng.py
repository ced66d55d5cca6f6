"""meshfuse's counter-based random number generator, written with torch integer ops.

A random value is a pure function of a *key* and a *counter*: no state, nothing to advance.
The key is a hash of a 64-bit seed, a 64-bit offset and optional extra words (an attention
shard's position); the counter is an element's global linear index. So the same element gets
the same value on any device, in any shard, at any world size, on CPU and CUDA alike.

Per element, the generator hashes 32-bit words with the ``lowbias32`` integer mixer (xor-shift-multiply,
multipliers published by C. Wellons), keyed per lane; products are split into 16-bit halves so
that no int64 product overflows. It is not nvFuser's Philox (the bits differ); its statistics
suit dropout masks and initialisation, not cryptography.

Float conversion: float32, float16 and bfloat16 take 24 random bits (``k / 2**24``, exact in
float32), float64 takes 53; results are in ``[0, 1)`` before scaling. Normal values use the
Box-Muller transform of two uniform lanes.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading

import torch

MASK32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: separates lanes and key words
_SEED_LIMIT = 2**63  # seeds and offsets are non-negative int64 values
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)``, without int64 overflow."""
    if isinstance(x, int):
        return (x * c) & MASK32
    high = ((x >> 16) * c) & 0xFFFF  # only its low 16 bits survive the shift below
    return ((high << 16) + (x & 0xFFFF) * c) & MASK32


def mix32(x):
    """A bijective 32-bit integer hash (an int or an int64 tensor of values in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def check_seed(name: str, value) -> int:
    """``value`` as a seed or offset: an integer in ``[0, 2**63)``; ValueError otherwise."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2**63), got {value!r}")
    return value


_DRAWS = threading.local()  # each thread's 0-d int64 tensor that draw_seed fills


def draw_seed() -> int:
    """A fresh seed from torch's default CPU generator (so ``torch.manual_seed`` decides it,
    and ranks seeded alike draw alike): the value ``torch.randint(0, 2**63 - 1, ())`` gives,
    drawn into a kept tensor (no tensor made per call: this runs on every dropout call)."""
    buffer = getattr(_DRAWS, "buffer", None)
    if buffer is None:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of it
            buffer = _DRAWS.buffer = torch.empty((), dtype=torch.int64, device="cpu")
    return buffer.random_(0, _SEED_LIMIT - 1).item()


def stream_key(seed: int, offset: int, *words: int) -> int:
    """A 64-bit stream key from a seed, an offset and extra non-negative int64 ``words``
    (BLAKE2b of them: distinct inputs give unrelated keys, in about a microsecond)."""
    data = struct.pack(f"<{len(words) + 2}q", seed, offset, *words)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def random_words(key: int, index: torch.Tensor, lane: int = 0,
                 bound: int | None = None) -> torch.Tensor:
    """32 random bits (int64 values in [0, 2**32)) for each counter in ``index`` (int64,
    non-negative), under ``key``; ``lane`` picks one of several independent words.
    ``bound``: an exclusive upper bound of the counters, when the caller knows one: at most
    ``2**32`` counters have no high word, whose mix is then one number for all (the same
    bits; the counters are never read back to the host, so a CUDA graph can capture this)."""
    k0 = mix32((key & MASK32) ^ _mul32(lane + 1, _GOLDEN))
    k1 = mix32(((key >> 32) & MASK32) ^ _mul32(lane + 7, _GOLDEN))
    if bound is not None and bound <= 2**32:
        high = mix32(k1)
    else:
        high = mix32((index >> 32) ^ k1)
    return mix32(mix32((index & MASK32) ^ k0) ^ high)


def unit_uniform(key: int, index: torch.Tensor, dtype: torch.dtype, lane: int = 0,
                 bound: int | None = None):
    """Uniform values in ``[0, 1)``: float64 for ``dtype`` float64 (53 bits), float32
    otherwise (24 bits); uses lanes ``lane`` (and ``lane + 1`` for float64); ``bound`` as
    :func:`random_words` takes it."""
    if dtype == torch.float64:
        bits = ((random_words(key, index, lane, bound) >> 5 << 26)
                | (random_words(key, index, lane + 1, bound) >> 6))
        return bits.to(torch.float64) * 2.0 ** -53
    return (random_words(key, index, lane, bound) >> 8).to(torch.float32) * 2.0 ** -24


def uniform(key: int, index: torch.Tensor, low: float, high: float,
            dtype: torch.dtype, bound: int | None = None) -> torch.Tensor:
    """Values uniform in ``[low, high)`` of ``dtype`` at counters ``index``.

    Low-precision results that round up to ``high`` are set to the largest value below it, so
    the interval stays half-open in every dtype.
    """
    u = unit_uniform(key, index, dtype, bound=bound)
    values = (u * (high - low) + low).to(dtype)
    if high > low:  # (filled on the device: no copy from the host to capture)
        top = torch.full((), high, dtype=dtype, device=values.device)
        below = torch.nextafter(top, torch.full((), low, dtype=dtype, device=values.device))
        values = torch.where(values >= top, below, values)
    return values


def normal(key: int, index: torch.Tensor, mean: float, std: float,
           dtype: torch.dtype, bound: int | None = None) -> torch.Tensor:
    """Normal values with ``mean`` and ``std`` of ``dtype`` at counters ``index``."""
    lanes = 2 if dtype == torch.float64 else 1
    u1 = 1.0 - unit_uniform(key, index, dtype, 0, bound)  # in (0, 1]: log is finite
    u2 = unit_uniform(key, index, dtype, lanes, bound)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return (z * std + mean).to(dtype)
