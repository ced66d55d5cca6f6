"""What the planner reads of a model: a transformer's sizes, one block repeated.

:func:`spec_of` takes a :class:`TransformerSpec`, a configuration with the example models'
names (``hidden``, ``heads``, ``kv_heads``, ``ffn``, ``layers``, ``vocab``, ``seq``:
:class:`meshfuse.examples.llama.LlamaConfig`) or Hugging Face's (``hidden_size``,
``num_attention_heads``...), a module holding one (``.cfg``, ``.config``), or a GPT fusion of
the examples (``sizes = (batch, seq, embed, heads)``, and ``layers`` for a stack: a GPT
block or stack); ``example_inputs`` gives
the batch and sequence when the model does not (``ids [batch, seq]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from meshfuse.errors import InputError


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer: ``layers`` identical blocks of ``hidden`` width,
    ``heads`` query heads (``kv_heads`` key/value heads), an MLP of ``ffn`` (SwiGLU's three
    matrices when ``gated``, else GPT's two with biases), a vocabulary, and a step of
    ``batch`` sequences of ``seq`` tokens in elements of ``dtype_bytes``."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    seq: int
    batch: int
    gated: bool = True
    dtype_bytes: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def block_parameters(self) -> int:
        """Parameters of one block."""
        h, f = self.hidden, self.ffn
        attention = 2 * h * h + 2 * h * self.kv_width
        mlp = 3 * h * f if self.gated else 2 * h * f + f + h
        norms = 2 * h if self.gated else 6 * h + 2 * self.kv_width  # GPT: + biases
        return attention + mlp + norms

    def parameters(self) -> int:
        """Parameters of the model (embedding and head untied)."""
        return self.layers * self.block_parameters() + 2 * self.vocab * self.hidden

    def block_flops_per_token(self) -> float:
        """Forward GEMM FLOPs of one block per token (attention's score and value products
        apart: :meth:`attention_flops_per_sequence`)."""
        h, f = self.hidden, self.ffn
        return 2.0 * (2 * h * h + 2 * h * self.kv_width + (3 if self.gated else 2) * h * f)

    def attention_flops_per_sequence(self) -> float:
        """Forward FLOPs of causal attention over one sequence (half the score matrix)."""
        return 2.0 * self.seq * self.seq * self.hidden

    def model_flops_per_step(self) -> float:
        """Forward and backward FLOPs of a step (3 forwards), for MFU."""
        tokens = self.batch * self.seq
        per_token = self.layers * self.block_flops_per_token() + 2.0 * self.vocab * self.hidden
        attention = self.layers * self.attention_flops_per_sequence() * self.batch
        return 3.0 * (tokens * per_token + attention)


# Published sizes (GPT-3: Brown et al. 2020; Llama 3: Meta's model cards), with the
# sequence and global batch the published runs this is set beside used.
GPT3_175B = TransformerSpec("GPT-3 175B", 12288, 96, 96, 4 * 12288, 96, 51200, 2048, 1536,
                            gated=False)
LLAMA3_8B = TransformerSpec("Llama-3 8B", 4096, 32, 8, 14336, 32, 128256, 8192, 64)
LLAMA3_70B = TransformerSpec("Llama-3 70B", 8192, 64, 8, 28672, 80, 128256, 8192, 128)
LLAMA3_405B = TransformerSpec("Llama-3 405B", 16384, 128, 8, 53248, 126, 128256, 8192, 512)
PRESETS = {s.name: s for s in (GPT3_175B, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B)}


def spec_of(model: Any, example_inputs: Any = None, dtype_bytes: int | None = None
            ) -> TransformerSpec:
    """The spec of ``model`` (see the module doc).

    Raises:
        InputError: when neither the model nor ``example_inputs`` give a size the planner
            needs.
    """
    if isinstance(model, TransformerSpec):
        return model
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None) or model
    batch, seq = _batch_and_seq(example_inputs)
    sizes = getattr(model, "sizes", None)  # the GPT fusions': (batch, seq, embed, heads)
    if isinstance(sizes, tuple) and len(sizes) == 4:
        cfg = _GptSizes(*sizes, layers=getattr(model, "layers", 1))
        batch, seq = batch or sizes[0], seq or sizes[1]
    get = (lambda *names, default=None: next(
        (getattr(src, n) for src in (cfg, model) for n in names if hasattr(src, n)), default))
    hidden = get("hidden", "hidden_size", "embed", "n_embd")
    heads = get("heads", "num_attention_heads", "n_head")
    values = {"hidden": hidden, "heads": heads,
              "seq": seq or get("seq", "max_position_embeddings", "n_positions"),
              "batch": batch or get("batch", default=1)}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise InputError(f"plan: cannot read {missing} from {type(model).__name__}; give a "
                         "TransformerSpec, a config with hidden/heads/seq, or example_inputs "
                         "(ids [batch, seq])")
    gated = get("kv_heads", "num_key_value_heads") is not None or hasattr(cfg, "rope_theta")
    kv = get("kv_heads", "num_key_value_heads", default=heads)
    ffn = get("ffn", "intermediate_size", default=4 * hidden)
    dtype = getattr(cfg, "torch_dtype", None)
    size = dtype_bytes or (dtype.itemsize if isinstance(dtype, torch.dtype) else 4)
    return TransformerSpec(type(model).__name__, int(hidden), int(heads), int(kv), int(ffn),
                           int(get("layers", "num_hidden_layers", "n_layer", default=1)),
                           int(get("vocab", "vocab_size", default=0)), int(values["seq"]),
                           int(values["batch"]), gated, size)


@dataclasses.dataclass(frozen=True)
class _GptSizes:
    """A GPT fusion's sizes under the names :func:`spec_of` reads."""

    batch: int
    seq: int
    embed: int
    heads: int
    layers: int = 1


def _batch_and_seq(example_inputs: Any) -> tuple[int | None, int | None]:
    if example_inputs is None:
        return None, None
    first = example_inputs
    while isinstance(first, (tuple, list)) and first:
        first = first[0]
    if isinstance(first, dict):
        first = next(iter(first.values()), None)
    if isinstance(first, torch.Tensor) and first.dim() >= 2:
        return int(first.shape[0]), int(first.shape[1])
    return None, None
