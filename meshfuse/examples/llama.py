"""A Llama-family language model written with meshfuse fusions, tensor and sequence parallel.

The model (pre-norm, no biases, untied embedding and LM head)::

    x = embed[ids]
    for each block:
        h = x + o(attention(rope(q(norm1(x))), rope(k(norm1(x))), v(norm1(x))))   # causal, GQA
        x = h + down(silu(gate(norm2(h))) * up(norm2(h)))                          # SwiGLU
    loss = cross_entropy(lm_head(norm(x)), targets)                               # class indices

Three kinds of fusion, each a :class:`~meshfuse.FusionModule` whose backward is derived:
:class:`LlamaEmbedding`, one :class:`LlamaBlock` per layer and :class:`LlamaHead` (final
norm, LM head, loss). One fusion per block rather than one for the whole model: every block
has the same program, so all layers share one definition and so one build (a model of 32
layers is built as fast as one of 2), autograd keeps what each block's backward reads between
blocks, and a layer is the unit a data-parallel strategy gathers and frees parameters by.

The schedule is Megatron's tensor + sequence parallelism on a 1-D mesh of ``d`` ranks, pinned
on the parameters and the residual stream, the rest derived by propagation:

- q, gate and up are column parallel (output features, so query heads, split); k and v too
  where ``d`` divides the key/value heads, else replicated (each rank projects all key/value
  heads and takes those its query heads read, as Megatron does when TP exceeds the kv heads);
  o and down are row parallel (input features split);
- the residual stream (the embedding's output, ``h`` and each block's output) is split on the
  sequence, so the RMSNorms and residual adds run on sequence shards: each block gathers its
  norms' outputs (2 allgathers) and reduce-scatters its row-parallel products (2
  reduce-scatters), in the forward and, transposed, in the backward;
- the embedding table and the LM head are split on the vocabulary: masked local lookups
  reduce-scattered onto the sequence split, and logits that stay sharded on the vocabulary
  into a loss-parallel cross entropy (per-token max, sum of exponentials and target logit
  reduced over the ranks, never a whole row of logits on one rank).

Parameters are named as ``transformers``' ``LlamaForCausalLM`` names them
(:func:`parameter_shapes`), so its state dict loads into the plain-PyTorch twin
(:mod:`meshfuse.examples.llama_torch`) and into ``LlamaForCausalLM`` alike.
"""

from __future__ import annotations

import dataclasses

import torch

from meshfuse.autodiff.fsdp_module import FullyShardedModule, prefetch_in_order
from meshfuse.autodiff.module import FusionModule
from meshfuse.dtypes import DataType
from meshfuse.frontend.fusion_definition import FusionDefinition
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.parallel.fsdp import NamedMesh, clip_grad_norm_, copies
from meshfuse.parallel.fsdp.transform import shard_axis


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The model's sizes (global) and element type."""

    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    seq: int = 16
    rope_theta: float = 10000.0
    eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads of an "
                             f"even size, and heads into {self.kv_heads} key/value groups")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def block_parameter_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """One block's parameters, by their name within a ``LlamaDecoderLayer``."""
    e, f, dh = cfg.hidden, cfg.ffn, cfg.head_dim
    return {
        "input_layernorm.weight": (e,),
        "self_attn.q_proj.weight": (cfg.heads * dh, e),
        "self_attn.k_proj.weight": (cfg.kv_heads * dh, e),
        "self_attn.v_proj.weight": (cfg.kv_heads * dh, e),
        "self_attn.o_proj.weight": (e, cfg.heads * dh),
        "post_attention_layernorm.weight": (e,),
        "mlp.gate_proj.weight": (f, e),
        "mlp.up_proj.weight": (f, e),
        "mlp.down_proj.weight": (e, f),
    }


def parameter_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The whole model's parameters, named as ``LlamaForCausalLM``'s state dict."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab, cfg.hidden)}
    for layer in range(cfg.layers):
        for name, shape in block_parameter_shapes(cfg).items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    shapes["model.norm.weight"] = (cfg.hidden,)
    shapes["lm_head.weight"] = (cfg.vocab, cfg.hidden)
    return shapes


def init_parameters(cfg: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Global initial values on the CPU (the same on every rank): norms near 1, weights
    scaled by 1/sqrt(fan_in), the embedding unit normal."""
    gen = torch.Generator().manual_seed(seed)
    result = {}
    for name, shape in parameter_shapes(cfg).items():
        x = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif "embed" not in name:
            x = x / shape[1] ** 0.5
        result[name] = x.to(cfg.torch_dtype)
    return result


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[seq, head_dim]`` of rotary position embeddings (rotate-half
    layout: the frequencies repeated over both halves), computed in float32."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(cfg.torch_dtype), angles.sin().to(cfg.torch_dtype)


def named_mesh(mesh: DeviceMesh | NamedMesh | None) -> NamedMesh | None:
    """``mesh`` with named dimensions: a 1-D meshfuse mesh is ``tp``."""
    if mesh is None or isinstance(mesh, NamedMesh):
        return mesh
    return NamedMesh(mesh, ("tp",))


class _LlamaFusion(FusionDefinition):
    """What the three fusions share: sizes, the mesh and the Megatron placements.

    ``mesh``: None (one device), a 1-D mesh (tensor parallel over all of it), or a
    :class:`NamedMesh` whose ``tp`` dimension (if any) the model is tensor parallel over
    (its other dimensions, such as ``dp``, are left to a data-parallel strategy)."""

    def __init__(self, cfg: LlamaConfig, batch: int,
                 mesh: DeviceMesh | NamedMesh | None = None) -> None:
        super().__init__()
        self.cfg, self.batch = cfg, batch
        self.named = named_mesh(mesh)
        self.mesh = None if self.named is None else self.named.mesh
        self.tp, self.cp = (1 if self.named is None or name not in self.named.names else
                            self.named.size(name) for name in ("tp", "cp"))
        self.dtype = DataType.from_torch(cfg.torch_dtype)
        self.params: dict = {}
        self.placements: list = []  # (tensor, tp axis, cp axis: each None or an axis)
        self.batch_inputs: list = []  # the inputs whose first axis is the batch (dp splits)

    def parameter(self, name: str, shape, axis: int | None):
        tv = self.define_tensor(list(shape), dtype=self.dtype, contiguity=True)
        self.params[name] = tv
        self.placements.append((tv, axis, None))
        return tv

    def pin(self, tv, axis: int | None, sequence: int | None = None):
        """Pins ``tv`` split on ``axis`` over ``tp`` (None: not) and, context parallel, on
        its ``sequence`` axis over ``cp`` (outside the tp split when both split it)."""
        self.placements.append((tv, axis, sequence))
        return tv

    def io(self, t):
        """``t`` in the model's dtype (nvFuser's promotion computes half-precision sums in
        float: they are cast back, and pinned alike)."""
        return t if t.dtype is self.dtype else self.ops.cast(t, self.dtype)

    def tokens(self):
        return self.define_tensor([self.batch, self.cfg.seq], dtype=DataType.Int,
                                  contiguity=True)

    def multidevice_schedule(self) -> None:
        if self.mesh is None:
            return
        for tv, axis, sequence in self.placements:
            tv.set_device_mesh(self.mesh)
            if sequence is not None and self.cp > 1:
                shard_axis(tv, self.named, "cp", sequence)
            if axis is not None and self.tp > 1:
                shard_axis(tv, self.named, "tp", axis)


class LlamaEmbedding(_LlamaFusion):
    """Input ``ids [batch, seq]`` (replicated), parameter ``model.embed_tokens.weight``
    (vocabulary split); output ``x [batch, seq, hidden]`` (sequence split)."""

    def definition(self) -> None:
        cfg = self.cfg
        self.ids = self.pin(self.tokens(), None, 1)
        self.batch_inputs = [self.ids]
        table = self.parameter("model.embed_tokens.weight", (cfg.vocab, cfg.hidden), 0)
        self.add_output(self.pin(self.ops.embedding_fwd(self.ids, table), 1, 1))


class LlamaBlock(_LlamaFusion):
    """One decoder layer: inputs ``x`` (sequence split), ``cos`` and ``sin`` (the RoPE
    tables, replicated), then :func:`block_parameter_shapes`' parameters; output the
    layer's ``x`` (sequence split)."""

    def definition(self) -> None:
        cfg, o = self.cfg, self.ops
        kv_axis = 0 if cfg.kv_heads % self.tp == 0 else None
        columns = {"q_proj": 0, "k_proj": kv_axis, "v_proj": kv_axis, "o_proj": 1,
                   "gate_proj": 0, "up_proj": 0, "down_proj": 1}
        x = self.pin(self.define_tensor([self.batch, cfg.seq, cfg.hidden], dtype=self.dtype,
                                        contiguity=True), 1, 1)
        self.batch_inputs = [x]
        self.rope = rope = [self.pin(self.define_tensor([cfg.seq, cfg.head_dim],
                                                        dtype=self.dtype, contiguity=True),
                                     None, 0) for _ in "cs"]
        p = {name.split(".")[-2]: self.parameter(name, shape, columns.get(name.split(".")[-2]))
             for name, shape in block_parameter_shapes(cfg).items()}
        n1 = self.gathered(o.rms_norm(x, p["input_layernorm"], cfg.eps))
        q = self.rotate(self.heads(o.linear(n1, p["q_proj"]), cfg.heads), *rope)
        k = self.rotate(self.heads(o.linear(n1, p["k_proj"]), cfg.kv_heads), *rope)
        v = self.heads(o.linear(n1, p["v_proj"]), cfg.kv_heads)
        attn, *_ = o.sdpfa_fwd(q, k, v, 0.0, True)
        h = self.residual(x, o.linear(self.merged(attn), p["o_proj"]))
        n2 = self.gathered(o.rms_norm(h, p["post_attention_layernorm"], cfg.eps))
        gated = o.mul(o.silu(o.linear(n2, p["gate_proj"])), o.linear(n2, p["up_proj"]))
        self.add_output(self.residual(h, o.linear(self.io(gated), p["down_proj"])))

    def gathered(self, t):
        """``t`` (a norm's output, sequence split), which the column-parallel projections
        read gathered: propagation and resharding gather it once for all of them
        (Megatron's gather at the region's input), replicated k/v projections included.
        Context parallel, it is pinned gathered over ``tp`` and still split over ``cp`` (left
        to propagation, the projections would follow the sequence split over both)."""
        return self.pin(self.ops.set(t), None, 1) if self.cp > 1 else t

    def residual(self, x, y):
        """``x + y``, sequence split (a row-parallel ``y`` is reduce-scattered into it)."""
        total = self.pin(self.ops.add(x, y), 1, 1)
        return self.pin(self.io(total), 1, 1) if total.dtype is not self.dtype else total

    def heads(self, t, n: int):
        """``[B, S, n * Dh]`` as ``[B, n, S, Dh]``."""
        b, s, dh = self.batch, self.cfg.seq, self.cfg.head_dim
        return self.ops.permute(self.ops.reshape(t, [b, s, n, dh]), [0, 2, 1, 3])

    def merged(self, t):
        b, s = self.batch, self.cfg.seq
        return self.ops.reshape(self.ops.permute(t, [0, 2, 1, 3]), [b, s, self.cfg.hidden])

    def rotate(self, t, cos, sin):
        """RoPE on ``t [B, n, S, Dh]``: ``t * cos + rotate_half(t) * sin``, rotate-half
        being ``cat(-t[..., Dh/2:], t[..., :Dh/2])``."""
        o = self.ops
        shape = [self.batch, t.materialized()[1].extent, self.cfg.seq, self.cfg.head_dim]
        half = shape[3] // 2
        first = o.slice(t, [0, 0, 0, 0], [*shape[:3], half])
        second = o.slice(t, [0, 0, 0, half], shape)
        rotated = o.cat([o.neg(second), first], 3)
        cos, sin = (o.broadcast_in_dim(c, shape, [2, 3]) for c in (cos, sin))
        return self.io(o.add(o.mul(t, cos), o.mul(rotated, sin)))


class LlamaHead(_LlamaFusion):
    """Inputs ``x [batch, seq, hidden]`` (sequence split) and ``targets [batch, seq]``
    (class indices, replicated), then ``model.norm.weight`` and ``lm_head.weight``
    (vocabulary split); output the mean cross entropy (replicated)."""

    def definition(self) -> None:
        cfg, o, b = self.cfg, self.ops, self.batch
        x = self.pin(self.define_tensor([b, cfg.seq, cfg.hidden], dtype=self.dtype,
                                        contiguity=True), 1, 1)
        self.targets = targets = self.pin(self.tokens(), None)
        self.batch_inputs = [x, targets]
        if self.cp > 1:  # the whole sequence for the loss (gathered over cp and tp)
            x = self.pin(self.ops.set(x), None)
        norm = self.parameter("model.norm.weight", (cfg.hidden,), None)
        head = self.parameter("lm_head.weight", (cfg.vocab, cfg.hidden), 0)
        logits = o.linear(o.rms_norm(x, norm, cfg.eps), head)
        loss = o.cross_entropy(o.reshape(logits, [b * cfg.seq, cfg.vocab]),
                               o.reshape(targets, [b * cfg.seq]))
        self.add_output(self.pin(loss, None))


def fusion_module(fd: _LlamaFusion, params: dict[str, torch.Tensor], prefix: str,
                  fsdp: NamedMesh | None = None) -> torch.nn.Module:
    """``fd`` as a module holding this rank's shards of its parameters (torch parameter names
    cannot hold dots: they are replaced by underscores): a FusionModule, or over the ``dp``
    dimension of ``fsdp`` a FullyShardedModule whose one layer is all of them (HSDP: also
    replicated over its ``replicate`` dimension, if it has one)."""
    fd.define()
    own = {name.replace(".", "_"): (tv, params[prefix + name])
           for name, tv in fd.params.items()}
    if fsdp is None:
        module = FusionModule(fd, own)
        module.copies = [copies(tv) for tv, _ in own.values()]
    else:
        replicate = "replicate" if "replicate" in fsdp.names else None
        module = FullyShardedModule(fd, own, [list(own)], fd.batch_inputs, fsdp,
                                    replicate=replicate)
        module.copies = module._copies
    module.fd = fd
    return module


class LlamaModel(torch.nn.Module):
    """The model as fusion modules on this rank: ``model(ids, targets)`` is the loss.

    Args:
        cfg: the sizes.
        batch: sequences per step (static, as every fusion's shapes).
        params: global initial values (:func:`init_parameters`' names).
        mesh: a 1-D mesh for tensor + sequence parallelism, a :class:`NamedMesh` with
            dimensions ``dp`` (fully sharded data parallel: each fusion's parameters
            sharded over it, the batch split over it), optionally ``replicate`` (HSDP: the
            parameters replicated over it, the batch split over it too), ``cp`` (context
            parallel: the sequence split over it, ring attention) and ``tp``; or None (one
            device).
        device: where the parameters and RoPE tables live.
    """

    def __init__(self, cfg: LlamaConfig, batch: int, params: dict[str, torch.Tensor],
                 mesh: DeviceMesh | NamedMesh | None = None, device=None) -> None:
        super().__init__()
        named = named_mesh(mesh)
        self.fsdp = named if named is not None and "dp" in named.names else None
        embed, head = LlamaEmbedding(cfg, batch, mesh), LlamaHead(cfg, batch, mesh)
        self.embed = fusion_module(embed, params, "", self.fsdp)
        block = LlamaBlock(cfg, batch, mesh)  # one definition, one build, for every layer
        self.blocks = torch.nn.ModuleList(
            fusion_module(block, params, f"model.layers.{i}.", self.fsdp)
            for i in range(cfg.layers))
        self.head = fusion_module(head, params, "", self.fsdp)
        if self.fsdp is not None:  # each fusion's gather launched under the one before
            prefetch_in_order([self.embed, *self.blocks, self.head])
        self._names = {f"blocks.{i}.{n.replace('.', '_')}": f"model.layers.{i}.{n}"
                       for i in range(cfg.layers) for n in block.params}
        self._names.update({f"{m}.{n.replace('.', '_')}": n
                            for m, fd in (("embed", embed), ("head", head)) for n in fd.params})
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.to(device)

    def checkpoint_names(self) -> dict[str, str]:
        """Each parameter's ``LlamaForCausalLM`` name, by its name here: what checkpoints
        and Hugging Face exports (:mod:`meshfuse.checkpoint`) call it."""
        return dict(self._names)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos, self.sin
        if self.fsdp is not None:  # this rank's rows of the batch (and positions: cp)
            ids = self.embed.shard_input(self.embed.fd.ids, ids)
            targets = self.head.shard_input(self.head.fd.targets, targets)
            if self.blocks and self.blocks[0].fd.cp > 1:
                cos, sin = (self.blocks[0].shard_input(tv, t)
                            for tv, t in zip(self.blocks[0].fd.rope, (cos, sin)))
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(x, targets)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips the gradients (this rank's shards) to a global norm of ``max_norm``, every
        element counted once; returns the norm before clipping."""
        parts = [self.embed, *self.blocks, self.head]
        return clip_grad_norm_([p for m in parts for p in m.parameters()], max_norm,
                               [n for m in parts for n in m.copies])
