"""Circuits: edge attribution patching (EAP, EAP-IG) and the faithfulness of the circuits it finds.

The graph is TransformerLens 4.3's residual-stream graph. *Writers* add to the residual stream:
the embeddings ``("embed", None, None)``, each attention head ``("attn_head_out", l, h)`` (its own
``z_h @ W_O[h]``, the output bias belonging to no head) and each MLP ``("mlp_out", l, None)``.
*Readers* take the residual stream in: each head's query input ``("q_input", l, h)``, key and value
inputs ``("k_input", l, g)``, ``("v_input", l, g)``, each MLP ``("mlp_in", l, None)`` and the
unembedding ``("logits", L - 1, None)``. An edge joins a writer to every reader after it, at the
same position. A reader's input is the residual stream *before* the block's norm (as TransformerLens's
``hook_q_input``/``hook_mlp_in`` and its final ``hook_resid_post``): the stream is then a plain sum of
the writers, which is what makes an edge's contribution a well-defined part of a reader's input.

Grouped-query attention stays grouped: a key/value head ``g`` is read by the ``H / Hkv`` query heads
of its group, so ``k_input``/``v_input`` nodes are numbered by key/value head (``g < Hkv``), as the
model computes them. (TransformerLens 4.3 refuses such models; hannamw/EAP-IG ungroups them, which
multiplies their key/value readers by the group size.) With as many key/value heads as heads the
graph is TransformerLens's node for node.

EAP scores an edge ``u -> v`` as ``(a_u(clean) - a_u(corrupted)) . d metric / d x_v`` with the
gradient taken on the corrupted run: TransformerLens's *denoising* sign, a positive score moves the
metric toward the clean run. It costs one clean forward, one corrupted forward and one backward:
the gradient with respect to each head's own input copy is not a tensor of the forward pass (the
heads share one normed input), so it is recovered by linearity, ``W_q[h]^T (d metric / d q_h)``
pulled back through the norm at that head's input (the norm's vector-Jacobian product, batched
over the heads). Scores are summed over positions (``per_position=True`` keeps them apart) and over
the rows of a batch: with a metric that averages over rows, as :class:`~attnlab.interpret.LogitDiff`
does, that is TransformerLens's mean over pairs.

EAP-IG replaces the one gradient by the mean of ``ig_steps`` gradients along a path from the
corrupted run toward the clean one, at ``alpha = k / ig_steps`` for ``k = 0 .. ig_steps - 1``
(hannamw/EAP-IG's steps; ``alpha = 0`` is the corrupted run, so ``ig_steps=1`` is EAP exactly):

* ``"EAP-IG-inputs"``: the token embeddings are interpolated; every edge reads those gradients.
* ``"EAP-IG-activations"`` (MIB's name): the outputs of one writer layer at a time (the embeddings,
  one layer's heads, one MLP) are interpolated, and the edges out of that layer read the gradients of
  its own runs. All runs of a call go through the model as the rows of a few batches, ``max_tokens``
  tokens a pass: a batch of pairs past it runs its rows in several passes, each following the metric's
  gradient at all the rows' logits (the metric reads them together; the rows are independent).

A circuit is a set of edges (:class:`Circuit`; :meth:`EdgeScores.top_n`, :meth:`EdgeScores.threshold`,
:meth:`EdgeScores.greedy`). :func:`circuit_metrics` runs the clean prompt with every edge outside the
circuit patched from the corrupted run: each reader's input is the live residual stream minus, for
each edge left out, the writer's live output plus its corrupted output (exact: the stream is a sum).
The full circuit gives the clean run, the empty one the corrupted run. :func:`faithfulness` is MIB's
normalized faithfulness ``(m(C) - m(corrupted)) / (m(clean) - m(corrupted))`` and
:func:`faithfulness_curve` MIB's summaries over edge budgets: CPR, the area under the faithfulness
curve, and CMD, the area between it and 1, both by the trapezoid rule over the budgets' fractions.

SAEs and transcoders (``edge_attribution(..., saes=[...])``, :func:`sae_graph`) are spliced in with
their error terms kept and add nodes at their hooks: each active latent ``j`` a writer of ``z_j
W_dec[j]``, an error node writing the rest of the SAE's output, and for a residual SAE an input reader
through which alone what came before reaches what comes after; an MLP-output SAE's or a transcoder's
latents replace the MLP's node. The stream stays a sum of writers, so all of the above holds.

Models: attnlab GPTs with pre-norm blocks (GPT-2, Llama and their kin, parallel residual included).
Post-norms (Gemma 2/3's sandwich, OLMo 2) normalise a sublayer's output before it joins the stream,
so a head's output is no longer its contribution; ``qk_norm="full"`` mixes all heads' queries. Both
are refused (TransformerLens refuses the first too).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.hardware import as_float64
from attnlab.interpret.hooks import HookPoint, activation_at, eval_mode, hooks
from attnlab.interpret.patching import finite_metric, metric_scalar, metric_with_gradient
from attnlab.interpret.sae import SAE, sae_point, splice

__all__ = [
    "MIB_BUDGETS",
    "Circuit",
    "EdgeGraph",
    "EdgeScores",
    "FaithfulnessCurve",
    "SAENodes",
    "circuit_metrics",
    "edge_attribution",
    "faithfulness",
    "faithfulness_curve",
    "sae_graph",
    "sae_place",
]

METHODS = ("EAP", "EAP-IG-inputs", "EAP-IG-activations")
# MIB's edge budgets as fractions of all edges (0.1% ... 50%).
MIB_BUDGETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)

Node = tuple  # (kind, layer, head), or (kind, layer, head, position) for position-resolved edges


# --------------------------------------------------------------------------------------------
# The graph
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SAENodes:
    """One spliced SAE's nodes (see :func:`sae_graph`): writers ``("sae_latent", hook, j)`` for each
    of ``latents`` and ``("sae_error", hook, None)``; a residual SAE also reads ``("sae_input", hook, None)``.

    ``hook`` is the point the SAE replaces (a transcoder's output hook), ``place`` one of ``resid_pre``,
    ``resid_mid``, ``resid_post`` (its latents replace the stream), ``mlp_out`` (they replace the MLP's
    output, which the SAE reads) or ``transcoder`` (they replace the MLP and read its input).
    """

    sae: nn.Module
    hook: str
    layer: int
    place: str
    latents: tuple[int, ...]

    @property
    def has_input(self) -> bool:
        return self.place.startswith("resid")

    @property
    def stage(self) -> float:
        """Where it sits among the writers' and readers' stages (EdgeGraph: 2l+1 heads, 2l+2 the MLP)."""
        offset = {"resid_pre": 0.5, "resid_mid": 1.5, "mlp_out": 2.0, "transcoder": 2.0, "resid_post": 2.4}
        return 2 * self.layer + offset[self.place]


@dataclass(frozen=True, eq=False)
class EdgeGraph:
    """Writers and readers of a model's residual stream, and which writer feeds which reader.

    ``valid (W, R)`` is True where writer ``w`` comes before reader ``r`` (an edge). Writers are
    ordered embed, then per layer its heads and its MLP; readers per layer ``H`` query heads,
    ``Hkv`` key heads, ``Hkv`` value heads and the MLP, then the logits.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool
    saes: tuple[SAENodes, ...] = ()
    writers: tuple[Node, ...] = field(init=False)
    readers: tuple[Node, ...] = field(init=False)
    valid: Tensor = field(init=False)
    n_base_writers: int = field(init=False)
    n_base_readers: int = field(init=False)

    @property
    def shape(self) -> tuple[int, int, int, bool]:
        """``(layers, heads, key/value heads, parallel)``: the model the graph is of."""
        return self.n_layers, self.n_heads, self.n_kv_heads, self.parallel

    def __post_init__(self) -> None:
        L, H, G = self.n_layers, self.n_heads, self.n_kv_heads
        writers: list[Node] = [("embed", None, None)]
        w_stage: list[float] = [0]
        readers: list[Node] = []
        r_stage: list[float] = []
        for layer in range(L):
            writers += [("attn_head_out", layer, h) for h in range(H)] + [("mlp_out", layer, None)]
            w_stage += [2 * layer + 1] * H + [2 * layer + 2]
            readers += [("q_input", layer, h) for h in range(H)]
            readers += [("k_input", layer, g) for g in range(G)] + [("v_input", layer, g) for g in range(G)]
            readers.append(("mlp_in", layer, None))
            # a parallel block's MLP reads the block's input: its own layer's heads do not reach it
            r_stage += [2 * layer + 1] * (H + 2 * G) + [2 * layer + 1 if self.parallel else 2 * layer + 2]
        readers.append(("logits", L - 1, None))
        r_stage.append(2 * L + 1)
        object.__setattr__(self, "n_base_writers", len(writers))
        object.__setattr__(self, "n_base_readers", len(readers))
        for s in self.saes:  # after the model's nodes: the index helpers below stay the model's
            writers += [("sae_latent", s.hook, j) for j in s.latents] + [("sae_error", s.hook, None)]
            w_stage += [s.stage] * (len(s.latents) + 1)
            if s.has_input:
                readers.append(("sae_input", s.hook, None))
                r_stage.append(s.stage)
        ws, rs = torch.tensor(w_stage, device="cpu")[:, None], torch.tensor(r_stage, device="cpu")[None, :]
        valid = ws < rs  # (W, R)
        for s in self.saes:
            if s.has_input:  # the stream is the SAE's output: what came before reaches later readers through it
                valid &= ~((ws < s.stage) & (rs > s.stage))
            else:  # the MLP's output is the SAE's latents and error: its own node writes nothing
                valid[self.head_writer(s.layer) + H] = False
        object.__setattr__(self, "writers", tuple(writers))
        object.__setattr__(self, "readers", tuple(readers))
        object.__setattr__(self, "valid", valid)

    @classmethod
    def of(cls, model: nn.Module) -> EdgeGraph:
        """The graph of an attnlab GPT (a ValueError for a model whose stream is not a sum of writers)."""
        cfg = _check_model(model)
        return cls(cfg.n_layers, cfg.n_heads, cfg.kv_heads, bool(cfg.parallel_residual))

    @property
    def n_edges(self) -> int:
        """Edges summed over positions (per position there are ``T`` times as many)."""
        return int(self.valid.sum())

    # Index helpers: the first writer and reader of a layer.
    def head_writer(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1)

    def reader_start(self, layer: int) -> int:
        return layer * (self.n_heads + 2 * self.n_kv_heads + 1)

    @property
    def readers_per_layer(self) -> int:
        return self.n_heads + 2 * self.n_kv_heads + 1

    @property
    def logits_reader(self) -> int:
        return self.n_base_readers - 1

    def sae_writers(self, i: int) -> slice:
        """The writers of SAE ``i``: its latents, then its error node."""
        start = self.n_base_writers + sum(len(s.latents) + 1 for s in self.saes[:i])
        return slice(start, start + len(self.saes[i].latents) + 1)

    def sae_reader(self, i: int) -> int:
        """The reader SAE ``i``'s latents read: its own input (a residual SAE), else its layer's MLP input."""
        s = self.saes[i]
        if not s.has_input:
            return self.reader_start(s.layer) + self.readers_per_layer - 1
        return self.n_base_readers + sum(t.has_input for t in self.saes[:i])

    def same_nodes(self, other: EdgeGraph) -> bool:
        return (self.writers, self.readers, self.parallel) == (other.writers, other.readers, other.parallel)

    def writer_index(self, node: Node) -> int:
        return _index(self.writers, node, "writer")

    def reader_index(self, node: Node) -> int:
        return _index(self.readers, node, "reader")


def _index(nodes: tuple[Node, ...], node: object, what: str) -> int:
    key = tuple(node)[:3] if isinstance(node, (tuple, list)) else node
    try:
        return nodes.index(key)
    except ValueError:
        raise ValueError(
            f"{node!r} is not a {what} of this graph; {what}s are (kind, layer, head) like {nodes[1]!r}"
        ) from None


def _check_model(model: object) -> object:
    cfg = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or cfg is None or not hasattr(model, "trf_blocks"):
        raise TypeError(f"model must be an attnlab GPT, got {type(model).__name__}")
    if not cfg.pre_norms or cfg.post_norms:
        raise ValueError(
            "edge attribution needs pre-norm blocks whose sublayer outputs add to the residual stream as they are; "
            f"this model has pre_norms={cfg.pre_norms}, post_norms={cfg.post_norms} (a head's output is normalised "
            "before it joins the stream, so it is not that head's contribution)"
        )
    if cfg.qk_norm == "full":
        raise ValueError(
            "edge attribution reads each head's query input apart; qk_norm='full' normalises all heads' queries "
            "together, so a head's query depends on the others' inputs"
        )
    return cfg


# --------------------------------------------------------------------------------------------
# SAEs and transcoders as nodes
# --------------------------------------------------------------------------------------------
_STREAM_HOOK = re.compile(r"blocks\.(\d+)\.hook_(resid_pre|resid_mid|resid_post|mlp_out)")


def _sae_place(sae: SAE, parallel: bool, where: str) -> tuple[str, int, str]:
    """``(hook, layer, place)`` of an SAE in the graph (see :class:`SAENodes`); a ValueError naming ``where``."""
    c, where = sae.cfg, f"{where}: " if where else ""
    out = _STREAM_HOOK.fullmatch(str(c.hook_name_out or c.hook_name))
    if c.transcoder:
        want = "resid_pre" if parallel else "resid_mid"
        m = _STREAM_HOOK.fullmatch(str(c.hook_name))
        if out is None or out[2] != "mlp_out" or m is None or m[2] != want or m[1] != out[1]:
            raise ValueError(
                f"{where}a transcoder node reads an MLP's input (blocks.L.hook_{want}) and writes its output "
                f"(blocks.L.hook_mlp_out); this one maps {c.hook_name!r} to {c.hook_name_out!r}"
            )
        return str(c.hook_name_out), int(out[1]), "transcoder"
    if out is None or (parallel and out[2] == "resid_mid"):
        raise ValueError(
            f"{where}an SAE node sits on the residual stream (blocks.L.hook_resid_pre, hook_resid_post"
            f"{'' if parallel else ', hook_resid_mid'}) or on an MLP's output (hook_mlp_out), not on {c.hook_name!r}"
        )
    return str(c.hook_name), int(out[1]), out[2]


def _check_saes(model: nn.Module, saes: object, parallel: bool) -> list[tuple[SAE, str, int, str]]:
    """``saes`` checked against ``model``: ``(sae, hook, layer, place)`` each; errors name ``saes[i]``."""
    if isinstance(saes, SAE) or not isinstance(saes, (list, tuple)):
        raise TypeError(f"saes must be a list of SAEs (attnlab.interpret.SAE), got {type(saes).__name__}")
    device = next(model.parameters()).device
    listed, seen = [], {}
    for i, sae in enumerate(saes):
        if not isinstance(sae, SAE):
            raise TypeError(f"saes[{i}] must be an attnlab SAE, got {type(sae).__name__}")
        try:
            sae.check_model(model)
        except ValueError as e:
            raise ValueError(f"saes[{i}]: {e}") from None
        if sae.W_enc.device != device:
            raise ValueError(f"saes[{i}] is on {sae.W_enc.device}, the model on {device}: move it with sae.to()")
        hook, layer, place = _sae_place(sae, parallel, f"saes[{i}]")
        if hook in seen:
            raise ValueError(f"saes[{seen[hook]}] and saes[{i}] both replace {hook}: one SAE per hook point")
        seen[hook] = i
        listed.append((sae, hook, layer, place))
    return listed


def sae_place(model: nn.Module, sae: SAE) -> tuple[str, int, str]:
    """``(hook, layer, place)`` of ``sae``'s nodes in ``model``'s graph (:class:`SAENodes`), or a
    ValueError saying why it cannot be a node (a hook that is neither the stream nor an MLP's output)."""
    cfg = _check_model(model)
    return _sae_place(sae, bool(cfg.parallel_residual), "")


@contextlib.contextmanager
def _spliced(model: nn.Module, saes: Sequence[SAE]) -> Iterator[None]:
    """The model with each SAE spliced in (error kept), the SAEs in eval mode meanwhile."""
    with contextlib.ExitStack() as stack:
        for s in saes:
            stack.enter_context(eval_mode(s))
            stack.enter_context(splice(model, s))
        yield


def sae_graph(
    model: nn.Module,
    saes: Sequence[SAE],
    prompts: Sequence[tuple[Tensor, Tensor]],
    max_latents: int = 64,
    *,
    max_tokens: int = 2048,
) -> EdgeGraph:
    """The graph of ``model`` with each of ``saes`` spliced in at its hook, its error term kept, and
    its latents nodes of their own (:class:`SAENodes`): a circuit read in features.

    Each latent ``j`` is a writer whose output is ``z_j W_dec[j]`` (times a run-time normalization's
    scale); later nodes read it through the residual stream. A residual SAE (``hook_resid_*``) replaces
    the stream: what was written before it reaches later readers only through its input node
    ``("sae_input", hook, None)``. An SAE on ``hook_mlp_out`` or a transcoder replaces the MLP's node (a
    transcoder's latents read the MLP's input). The error node holds all of the SAE's output that no
    listed latent writes (``x - x^``, the decoder's bias, a skip connection, the latents left out), so
    the stream stays the sum of the writers, exactly.

    Latents: those active (nonzero) at some position of ``prompts`` (``(clean, corrupted)`` token ids
    ``(B, T)`` each); past ``max_latents`` per SAE, the ones whose output changes most between the clean
    and corrupted prompts (``sum |z_clean - z_corrupted| * |W_dec[j]|``) are kept: memory stays bounded.
    The prompts run ``max_tokens`` tokens a pass (a row at least).
    """
    cfg = _check_model(model)
    listed = _check_saes(model, saes, bool(cfg.parallel_residual))
    if isinstance(max_latents, bool) or not isinstance(max_latents, int) or max_latents < 0:
        raise ValueError(f"max_latents must be a non-negative int, got {max_latents!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    pairs = [_check_pair(model, c, x) for c, x in prompts]
    base = EdgeGraph.of(model)
    names = [sae_point(sae, "acts_post") for sae, *_ in listed]
    active = [torch.zeros(sae.cfg.d_sae, dtype=torch.bool, device="cpu") for sae, *_ in listed]
    change = [torch.zeros(sae.cfg.d_sae, dtype=torch.float64, device="cpu") for sae, *_ in listed]
    cache: dict[str, Tensor] = {}
    with eval_mode(model), _spliced(model, [sae for sae, *_ in listed]), torch.no_grad():
        for clean, corrupted in pairs:
            z = []
            for idx in (clean, corrupted):
                parts = []
                for rows in _row_chunks(*idx.shape, max_tokens):
                    with hooks(model, {n: lambda x, hook: cache.__setitem__(hook.name, x) for n in names}):
                        model(idx[rows])
                    parts.append([cache[n].flatten(0, -2) for n in names])
                z.append([torch.cat(p) for p in zip(*parts, strict=True)])  # (B T, d_sae) each
            for i, (sae, *_) in enumerate(listed):
                active[i] |= ((z[0][i] != 0) | (z[1][i] != 0)).any(0).cpu()
                norms = as_float64(sae.W_dec.detach().norm(dim=-1))
                change[i] += (as_float64((z[0][i] - z[1][i]).abs()).sum(0) * norms).cpu()
    nodes = []
    for i, (sae, hook, layer, place) in enumerate(listed):
        cand = active[i].nonzero()[:, 0]
        best = torch.sort(change[i][cand], descending=True, stable=True).indices[:max_latents]
        nodes.append(SAENodes(sae, hook, layer, place, tuple(sorted(cand[best].tolist()))))
    return EdgeGraph(base.n_layers, base.n_heads, base.n_kv_heads, base.parallel, tuple(nodes))


# --------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class EdgeScores:
    """Every edge's score: ``scores (W, R)`` (or ``(T, W, R)`` per position), zero where no edge.

    ``items()`` yields ``(writer, reader, score)`` for every edge (per position: the nodes carry the
    position as a fourth entry, TransformerLens's position-resolved nodes).
    """

    graph: EdgeGraph
    scores: Tensor
    method: str
    ig_steps: int
    per_position: bool

    def __post_init__(self) -> None:
        # a NaN would rank as the strongest edge and poison every circuit chosen from the scores
        bad = ~torch.isfinite(self.scores) & self._mask()
        if bad.any():
            w, r, score = self._edge(int(bad.flatten().nonzero()[0]))
            raise ValueError(
                f"scores must be finite, got {score} on {int(bad.sum())} edges (the first {w!r} -> {r!r}): the model's "
                "activations or the metric's gradient are not finite on these prompts"
            )

    def _mask(self) -> Tensor:
        return self.graph.valid.to(self.scores.device).expand_as(self.scores)

    def items(self) -> Iterator[tuple[Node, Node, float]]:
        g, scores = self.graph, self.scores.tolist()  # (one read of the device's values, not one an edge)
        if not self.per_position:
            for w, r in self.graph.valid.nonzero().tolist():
                yield g.writers[w], g.readers[r], scores[w][r]
            return
        for t in range(self.scores.shape[0]):
            for w, r in self.graph.valid.nonzero().tolist():
                yield (*g.writers[w], t), (*g.readers[r], t), scores[t][w][r]

    def __len__(self) -> int:
        return int(self._mask().sum())

    def __getitem__(self, edge: tuple[Node, Node]) -> float:
        if not isinstance(edge, tuple) or len(edge) != 2:
            raise KeyError(f"an edge is (writer, reader), got {edge!r}")
        writer, reader = edge
        w, r = self.graph.writer_index(writer), self.graph.reader_index(reader)
        if not self.graph.valid[w, r]:
            raise KeyError(f"{writer!r} -> {reader!r} is not an edge (the writer does not come before the reader)")
        t = _position("edge", writer, reader, self.scores.shape[0] if self.per_position else None)
        return float(self.scores[w, r] if t is None else self.scores[t, w, r])

    def top(self, n: int = 10) -> list[tuple[Node, Node, float]]:
        """The ``n`` edges of largest ``|score|``, strongest first (a strongly negative edge matters too)."""
        order = self._ranked()[: _count("n", n)]
        return [self._edge(i) for i in order.tolist()]

    def _ranked(self) -> Tensor:
        """Flat indices of the edges by decreasing ``|score|`` (ties: enumeration order)."""
        flat = self.scores.abs().masked_fill(~self._mask(), -1.0).flatten()
        order = torch.sort(flat, descending=True, stable=True).indices
        return order[: len(self)]

    def _edge(self, flat: int) -> tuple[Node, Node, float]:
        R, W = len(self.graph.readers), len(self.graph.writers)
        t, rest = divmod(flat, W * R)
        w, r = divmod(rest, R)
        score = float(self.scores.flatten()[flat])
        if self.per_position:
            return (*self.graph.writers[w], t), (*self.graph.readers[r], t), score
        return self.graph.writers[w], self.graph.readers[r], score

    # Circuit selection ---------------------------------------------------------------------
    def top_n(self, n: int) -> Circuit:
        """The circuit of the ``n`` edges of largest ``|score|``."""
        mask = torch.zeros(self.scores.numel(), dtype=torch.bool, device="cpu")
        mask[self._ranked()[: _count("n", n)].cpu()] = True
        return Circuit(self.graph, mask.view(self.scores.shape))

    def threshold(self, t: float) -> Circuit:
        """The circuit of the edges with ``|score| >= t``."""
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise TypeError(f"t must be a finite number, got {t!r}")
        return Circuit(self.graph, ((self.scores.abs() >= t) & self._mask()).cpu())

    def greedy(self, n: int) -> Circuit:
        """Grow a circuit from the logits, ``n`` edges: each step adds the edge of largest ``|score|``
        whose reader belongs to a node already in the circuit (hannamw/EAP-IG's ``apply_greedy``), so
        every edge lies on a path to the logits. Position-summed scores only."""
        if self.per_position:
            raise ValueError("greedy selection works on position-summed scores; use per_position=False")
        n = _count("n", n)
        g = self.graph
        group = g.n_heads // g.n_kv_heads
        by_reader: dict[int, list[int]] = {}
        for w, r in g.valid.nonzero().tolist():
            by_reader.setdefault(r, []).append(w)
        absolute = self.scores.abs().tolist()
        heap: list[tuple[float, int, int, int]] = []
        tick = 0

        def open_reader(r: int) -> None:
            nonlocal tick
            for w in by_reader.get(r, ()):
                heapq.heappush(heap, (-absolute[w][r], tick, w, r))
                tick += 1

        open_readers: set[int] = set()

        sae_of = {w: i for i in range(len(g.saes)) for w in range(g.sae_writers(i).start, g.sae_writers(i).stop)}

        def open_node(w: int) -> None:  # a writer joined: its own inputs become candidates
            kind, layer, head = g.writers[w]
            if kind == "embed":
                return
            if w in sae_of:  # a latent or error node reads the SAE's input (an MLP SAE's: the MLP's)
                wanted = [g.sae_reader(sae_of[w])]
            elif kind == "mlp_out":
                wanted = [g.reader_start(layer) + g.readers_per_layer - 1]
            else:
                kv, base = head // group, g.reader_start(layer)
                wanted = [base + head, base + g.n_heads + kv, base + g.n_heads + g.n_kv_heads + kv]
            for r in wanted:
                if r not in open_readers:
                    open_readers.add(r)
                    open_reader(r)

        logits = g.logits_reader
        open_readers.add(logits)
        open_reader(logits)
        mask = torch.zeros_like(g.valid)
        taken = 0
        while heap and taken < n:
            _, _, w, r = heapq.heappop(heap)
            if mask[w, r]:
                continue
            mask[w, r] = True
            taken += 1
            open_node(w)
        return Circuit(g, mask)


def _position(what: str, writer: Node, reader: Node, T: int | None) -> int | None:
    """The position of a position-resolved edge (both nodes carry it, as a fourth entry), None for a
    position-summed one; ``T``: the positions there are, None where nodes carry none."""
    sizes = (len(writer), len(reader))
    if T is None:
        if sizes != (3, 3):
            raise ValueError(f"{what}: position-summed nodes are (kind, layer, head), got {writer!r} -> {reader!r}")
        return None
    if sizes != (4, 4):
        raise ValueError(
            f"{what}: position-resolved nodes are (kind, layer, head, position), got {writer!r} -> {reader!r}"
        )
    t = writer[3]
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < T:
        raise KeyError(f"{what}: a position is an int in [0, {T}), got {t!r}")
    if reader[3] != t:
        raise KeyError(f"{what}: {writer!r} -> {reader!r} is not an edge (an edge joins nodes at the same position)")
    return t


def _count(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeError(f"{name} must be a non-negative int (a number of edges), got {n!r}")
    return n


@dataclass(eq=False)
class Circuit:
    """A set of edges of ``graph``: ``mask (W, R)`` (or ``(T, W, R)`` per position), True = kept."""

    graph: EdgeGraph
    mask: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.mask, Tensor) or self.mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {type(self.mask).__name__}")
        shape = tuple(self.graph.valid.shape)
        if self.mask.dim() not in (2, 3) or tuple(self.mask.shape[-2:]) != shape:
            raise ValueError(f"mask must have shape {shape} or (T, *{shape}), got {tuple(self.mask.shape)}")
        self.mask = self.mask & self.graph.valid

    def __len__(self) -> int:
        return int(self.mask.sum())

    def edges(self) -> Iterator[tuple[Node, Node]]:
        g = self.graph
        if self.mask.dim() == 2:
            for w, r in self.mask.nonzero().tolist():
                yield g.writers[w], g.readers[r]
        else:
            for t, w, r in self.mask.nonzero().tolist():
                yield (*g.writers[w], t), (*g.readers[r], t)

    @classmethod
    def from_edges(cls, graph: EdgeGraph, edges: Sequence[tuple[Node, Node]], positions: int | None = None) -> Circuit:
        """A circuit of ``(writer, reader)`` pairs (a trailing score is ignored): position-summed, or with
        ``positions=T`` (the prompts' length) per position, of position-resolved nodes (a fourth entry,
        as :meth:`EdgeScores.top` gives them with ``per_position=True``)."""
        if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 1):
            raise ValueError(f"positions must be the prompts' length (an int >= 1) or None, got {positions!r}")
        mask = torch.zeros((positions or 1, *graph.valid.shape), dtype=torch.bool, device="cpu")
        for i, edge in enumerate(edges):
            if not isinstance(edge, (tuple, list)) or len(edge) not in (2, 3):
                raise ValueError(f"edges[{i}] must be (writer, reader) or (writer, reader, score), got {edge!r}")
            w, r = graph.writer_index(edge[0]), graph.reader_index(edge[1])
            if not graph.valid[w, r]:
                raise ValueError(f"edges[{i}] = {edge[0]!r} -> {edge[1]!r} is not an edge of the graph")
            if positions is None and (len(edge[0]) == 4 or len(edge[1]) == 4):
                raise ValueError(
                    f"edges[{i}] = {edge[0]!r} -> {edge[1]!r} is position-resolved: give positions=T (the prompts' "
                    "length) for a per-position circuit, or nodes (kind, layer, head) for a position-summed one"
                )
            try:
                t = _position(f"edges[{i}]", edge[0], edge[1], positions)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
            mask[t or 0, w, r] = True
        return cls(graph, mask if positions else mask[0])

    @classmethod
    def full(cls, graph: EdgeGraph) -> Circuit:
        return cls(graph, graph.valid.clone())

    @classmethod
    def empty(cls, graph: EdgeGraph) -> Circuit:
        return cls(graph, torch.zeros_like(graph.valid))

    @classmethod
    def random(cls, graph: EdgeGraph, n: int, generator: torch.Generator | None = None) -> Circuit:
        """``n`` edges drawn uniformly without replacement (the baseline a found circuit must beat)."""
        n = _count("n", n)
        edges = graph.valid.flatten().nonzero()[:, 0]
        if n > edges.numel():
            raise ValueError(f"n={n} is more than the graph's {edges.numel()} edges")
        mask = torch.zeros(graph.valid.numel(), dtype=torch.bool, device="cpu")
        mask[edges[torch.randperm(edges.numel(), generator=generator, device="cpu")[:n]]] = True
        return cls(graph, mask.view(graph.valid.shape))


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def _check_inputs(model: nn.Module, clean: object, corrupted: object, metric: object) -> tuple[Tensor, Tensor]:
    _check_model(model)
    out = _check_pair(model, clean, corrupted)
    if not callable(metric):
        raise TypeError(f"metric must be a function logits (B, T, V) -> scalar, got {type(metric).__name__}")
    return out


def _check_pair(model: nn.Module, clean: object, corrupted: object) -> tuple[Tensor, Tensor]:
    out = []
    for name, idx in (("clean", clean), ("corrupted", corrupted)):
        if not isinstance(idx, Tensor):
            raise TypeError(f"{name} must be a tensor of token ids, (T,) or (B, T), got {type(idx).__name__}")
        if idx.dim() == 1:
            idx = idx.unsqueeze(0)
        if idx.dim() != 2:
            raise ValueError(f"{name} must be token ids of shape (T,) or (B, T), got shape {tuple(idx.shape)}")
        out.append(model.check_idx(idx))
    if out[0].shape != out[1].shape:
        raise ValueError(
            f"clean and corrupted must have the same shape (edges pair positions), got {tuple(out[0].shape)} "
            f"and {tuple(out[1].shape)}"
        )
    return out[0], out[1]


def _logits_grad(metric: Callable, logits: Tensor) -> Tensor:
    """The metric's gradient with respect to ``logits`` (all of a run's rows: the metric reads them together)."""
    with torch.enable_grad():
        x = logits.detach().requires_grad_(True)
        return torch.autograd.grad(metric_with_gradient(metric, x), x)[0]


def _row_chunks(B: int, T: int, max_tokens: int | None) -> list[slice]:
    """``B`` rows in slices of at most ``max_tokens`` tokens (a row at least: its positions run together)."""
    per = B if max_tokens is None else max(1, max_tokens // T)
    return [slice(lo, min(B, lo + per)) for lo in range(0, B, per)]


def _forward(model: nn.Module, idx: Tensor, replace: dict | None = None, out_proj: dict | None = None) -> Tensor:
    """The logits of one plain forward, without gradient, with ``replace``'s and ``out_proj``'s changes."""
    blocks = model.trf_blocks
    handles = [blocks[layer].att.out_proj.register_forward_pre_hook(f) for layer, f in (out_proj or {}).items()]
    try:
        with torch.no_grad(), hooks(model, replace or {}):
            return model(idx)
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------
# Writers: each writer's output, one forward
# --------------------------------------------------------------------------------------------
class _Writers:
    """Records each writer's output during one forward pass: ``out (B, T, W, d)`` when done."""

    def __init__(self, model: nn.Module, graph: EdgeGraph) -> None:
        self.model, self.graph = model, graph
        self.parts: dict[int, Tensor] = {}
        self.seen: dict[str, Tensor] = {}

    def fns(self) -> dict[str, Callable]:
        fns: dict[str, Callable] = {"blocks.0.hook_resid_pre": self._embed}
        for layer in range(self.graph.n_layers):
            fns[f"blocks.{layer}.hook_mlp_out"] = self._mlp(layer)
        for i, s in enumerate(self.graph.saes):  # hook points while the SAEs are spliced in
            for point in ("input", "acts_post"):
                fns[sae_point(s.sae, point)] = lambda x, hook: self.seen.__setitem__(hook.name, x.detach())
            fns[sae_point(s.sae, "output")] = self._sae(i)
        return fns

    def _sae(self, i: int) -> Callable:
        s, start = self.graph.saes[i], self.graph.sae_writers(i).start

        def fn(y: Tensor, hook: HookPoint) -> None:
            x, z = (self.seen[sae_point(s.sae, p)] for p in ("input", "acts_post"))
            self.parts[start] = sae_parts(s, x, z, y.detach())  # (B, T, n + 1, d)

        return fn

    def torch_hooks(self) -> list:
        handles = []
        for layer, block in enumerate(self.model.trf_blocks):
            handles.append(block.att.out_proj.register_forward_pre_hook(self._heads(layer)))
        return handles

    def _embed(self, x: Tensor, hook: HookPoint) -> None:
        self.parts[0] = x.detach()[:, :, None]  # (B, T, 1, d): everything before block 0 (token + position)

    def _mlp(self, layer: int) -> Callable:
        def fn(x: Tensor, hook: HookPoint) -> None:
            self.parts[self.graph.head_writer(layer) + self.graph.n_heads] = x.detach()[:, :, None]  # (B, T, 1, d)

        return fn

    def _heads(self, layer: int) -> Callable:
        att = self.model.trf_blocks[layer].att

        def pre(module: nn.Module, args: tuple) -> None:
            self.parts[self.graph.head_writer(layer)] = head_results(att, args[0].detach())  # (B, T, H, d)

        return pre

    def stacked(self) -> Tensor:
        return torch.cat([self.parts[k] for k in sorted(self.parts)], dim=2)  # (B, T, W, d)


def sae_parts(s: SAENodes, x: Tensor, z: Tensor, y: Tensor) -> Tensor:
    """An SAE's writers' outputs ``(B, T, n + 1, d)``: each listed latent's write, then the error node's
    (the SAE's output ``y (B, T, d)`` less those writes), from its input ``x`` and latents ``z (B, T, d_sae)``."""
    with torch.no_grad():
        writes = s.sae.latent_writes(z, s.latents, x).to(y.dtype)  # (B, T, n, d)
        return torch.cat([writes, (y - writes.sum(2))[:, :, None]], dim=2)


def _dense(weight: Tensor) -> Tensor:
    """A weight as a plain tensor, outside autograd: a GGUF matrix kept quantized is dequantized here
    (its rows are sliced per head, which its packed blocks do not allow)."""
    dequantize = getattr(weight, "dequantize", None)
    if type(weight) not in (Tensor, nn.Parameter) and callable(dequantize):
        weight = dequantize()
    return weight.detach()


def head_results(att: nn.Module, z: Tensor) -> Tensor:
    """Each head's own write to the stream, ``z_h @ W_O[:, h]^T``: ``z (B, T, H * hd)`` -> ``(B, T, H, d)``
    (TransformerLens's ``hook_result``, without the output bias, which belongs to no head)."""
    B, T, _ = z.shape
    w_o = _dense(att.out_proj.weight).view(-1, att.num_heads, att.head_dim)  # (d, H, hd)
    return torch.einsum("bthe,dhe->bthd", z.view(B, T, att.num_heads, att.head_dim), w_o)


def _run_writers(
    model: nn.Module, graph: EdgeGraph, idx: Tensor, max_tokens: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(writers (B, T, W, d), logits)`` of a plain forward, ``max_tokens`` tokens a pass (rows are independent)."""
    parts = []
    for rows in _row_chunks(*idx.shape, max_tokens):
        rec = _Writers(model, graph)
        handles = rec.torch_hooks()
        try:
            with torch.no_grad(), hooks(model, rec.fns()):
                logits = model(idx[rows])
        finally:
            for h in handles:
                h.remove()
        parts.append((rec.stacked(), logits))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([w for w, _ in parts]), torch.cat([x for _, x in parts])


# --------------------------------------------------------------------------------------------
# Readers: the gradient at each reader's own input, one backward
# --------------------------------------------------------------------------------------------
def _reader_grads(
    model: nn.Module,
    graph: EdgeGraph,
    idx: Tensor,
    objective: Callable[[Tensor], Tensor],
    replace: dict[str, Callable] | None = None,
    out_proj_replace: dict[int, Callable] | None = None,
) -> Iterator[Tensor]:
    """One forward and one backward of ``objective(logits)``; then, layer by layer, ``(B, T, R_l, d)``
    (its readers' input gradients) and last the logits reader's ``(B, T, 1, d)``.

    ``replace`` adds hook functions (interpolated activations); the embeddings start the graph, so
    no weight gets a gradient.
    """
    kept: dict[str, Tensor] = {}

    def start(x: Tensor, hook: HookPoint) -> Tensor:
        return x.detach().requires_grad_(True)

    def keep(x: Tensor, hook: HookPoint) -> None:
        kept[hook.name] = x

    def clone_input(name: str) -> Callable:
        def pre(module: nn.Module, args: tuple) -> tuple:
            x = args[0].clone()  # its own node: the gradient of this reader alone, not of the skip path
            kept[name] = x
            return (x, *args[1:])

        return pre

    def clone_point(name: str) -> Callable:
        def fn(x: Tensor, hook: HookPoint) -> Tensor:
            kept[name] = x.clone()  # what the SAE reads: its latents' gradient alone (the error has none)
            return kept[name]

        return fn

    fns: dict[str, list[Callable]] = {}
    for name, fn in (replace or {}).items():
        fns.setdefault(name, []).append(fn)
    fns.setdefault("hook_embed", []).append(start)  # after an interpolation: the graph starts on the path
    for layer in range(graph.n_layers):
        for step in ("q", "k", "v"):
            fns.setdefault(f"blocks.{layer}.attn.hook_{step}", []).append(keep)
        fns.setdefault(f"blocks.{layer}.hook_resid_pre", []).append(keep)
    sae_in = [i for i, s in enumerate(graph.saes) if s.place != "mlp_out"]
    for i in sae_in:
        fns.setdefault(sae_point(graph.saes[i].sae, "input"), []).append(clone_point(f"sae_in.{i}"))
    handles = [model.final_norm.register_forward_pre_hook(clone_input("final"))]
    for layer, block in enumerate(model.trf_blocks):
        handles.append(block.norm2.register_forward_pre_hook(clone_input(f"mlp_in.{layer}")))
        if out_proj_replace and layer in out_proj_replace:
            handles.append(block.att.out_proj.register_forward_pre_hook(out_proj_replace[layer]))
    try:
        with torch.enable_grad(), hooks(model, fns):
            value = objective(model(idx))
            names = [f"blocks.{layer}.attn.hook_{s}" for layer in range(graph.n_layers) for s in "qkv"]
            names += [f"mlp_in.{layer}" for layer in range(graph.n_layers)] + ["final"]
            names += [f"sae_in.{i}" for i in sae_in]
            grads = torch.autograd.grad(value, [kept[n] for n in names], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    grad = {n: torch.zeros_like(kept[n]) if g is None else g for n, g in zip(names, grads, strict=True)}
    for i in sae_in:
        if graph.saes[i].place == "transcoder":  # its latents read the MLP's input (the MLP's own output is gone)
            layer = graph.saes[i].layer
            grad[f"mlp_in.{layer}"] = grad[f"mlp_in.{layer}"] + grad.pop(f"sae_in.{i}")
    return _layer_grads(model, kept, grad)


def _layer_grads(model: nn.Module, kept: dict[str, Tensor], grad: dict[str, Tensor]) -> Iterator[Tensor]:
    """Per reader layer, one at a time (each is ``R_l * d`` numbers per token: they are contracted and
    dropped as they come), its readers' input gradients ``(B, T, R_l, d)``; then the logits' ``(B, T, 1, d)``
    and, if there are any, the residual SAEs' inputs' ``(B, T, n, d)``."""
    for layer, block in enumerate(model.trf_blocks):
        att = block.att
        d = att.d_in
        per_head = []
        for s, w in (("q", att.W_query), ("k", att.W_key), ("v", att.W_value)):
            g = grad[f"blocks.{layer}.attn.hook_{s}"]  # (B, T, H or Hkv, hd)
            # the gradient at each head's normed input: W_h^T (d metric / d q_h), by linearity
            w_h = _dense(w.weight).view(g.shape[2], att.head_dim, d)  # (heads, hd, d)
            per_head.append(torch.einsum("bthe,hed->bthd", g, w_h))
        u = torch.cat(per_head, dim=2)  # (B, T, H + 2 Hkv, d)
        x = kept[f"blocks.{layer}.hook_resid_pre"].detach()  # (B, T, d): the stream the heads read
        with torch.enable_grad():
            copies = x[:, :, None].expand_as(u).clone().requires_grad_(True)  # one input per head
            (g_attn,) = torch.autograd.grad(block.norm1(copies), copies, u)  # (B, T, H + 2 Hkv, d)
        yield torch.cat([g_attn, grad[f"mlp_in.{layer}"][:, :, None]], dim=2)  # (B, T, R_l, d)
    yield grad["final"][:, :, None]  # (B, T, 1, d)
    sae_in = sorted((n for n in grad if n.startswith("sae_in.")), key=lambda n: int(n[7:]))
    if sae_in:
        yield torch.stack([grad[n] for n in sae_in], dim=2)  # (B, T, n, d), in the SAEs' order


def _contract(delta: Tensor, g: Tensor, per_position: bool) -> Tensor:
    """``delta (B, T, W, d) . g (B, T, R, d)`` summed over rows and width: ``(W, R)`` or ``(T, W, R)``."""
    if per_position:
        return torch.einsum("btwd,btrd->twr", delta, g)
    W, R = delta.shape[2], g.shape[2]
    return delta.permute(2, 0, 1, 3).reshape(W, -1) @ g.permute(0, 1, 3, 2).reshape(-1, R)  # (W, R)


def _add_layer(
    graph: EdgeGraph,
    layer: int,
    delta: Tensor,
    g: Tensor,
    per_position: bool,
    out: Tensor,
    writers: slice | None = None,
) -> None:
    """Add reader layer ``layer``'s scores (``layer == n_layers``: the logits, ``n_layers + 1``: the
    residual SAEs' inputs) into ``out (W, R)`` or ``(T, W, R)``, for ``writers`` (default all)."""
    lo = graph.reader_start(layer) if layer <= graph.n_layers else graph.n_base_readers
    hi = lo + g.shape[2]
    # writers up to this layer's heads (the MLP reader may read them; the mask drops the rest)
    W = len(graph.writers)
    top = W if layer >= graph.n_layers else graph.head_writer(layer) + graph.n_heads
    w = range(W)[slice(None) if writers is None else writers]
    spans = [(w.start, min(w.stop, top))]
    if top < W and writers is None and graph.saes:
        spans.append((graph.n_base_writers, W))  # the SAEs' writers, listed after the model's
    for w_lo, w_hi in spans:
        if w_lo >= w_hi:
            continue  # the writers come after every reader of this layer
        part = _contract(delta[:, :, w_lo:w_hi].to(out.dtype), g.to(out.dtype), per_position)
        if per_position:
            out[:, w_lo:w_hi, lo:hi] += part
        else:
            out[w_lo:w_hi, lo:hi] += part


# --------------------------------------------------------------------------------------------
# Edge attribution
# --------------------------------------------------------------------------------------------
def edge_attribution(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable[[Tensor], Tensor],
    method: str = "EAP",
    ig_steps: int = 5,
    per_position: bool = False,
    *,
    max_tokens: int = 2048,
    saes: Sequence[SAE] = (),
    max_latents: int = 64,
    graph: EdgeGraph | None = None,
) -> EdgeScores:
    """Every edge's attribution score (see the module's notes for the graph, methods and sign).

    Args:
        model: an attnlab GPT with pre-norm blocks.
        clean, corrupted: token ids ``(T,)`` or ``(B, T)`` of the same shape (a batch of pairs).
        metric: logits ``(B, T, V)`` -> scalar tensor; averaged over rows for a batch to get
            TransformerLens's mean over pairs (:func:`~attnlab.interpret.logit_diff` does).
        method: ``"EAP"``, ``"EAP-IG-inputs"`` or ``"EAP-IG-activations"``.
        ig_steps: points on the integration path (EAP-IG only; 1 gives EAP).
        per_position: keep each position's edges apart: scores ``(T, W, R)``.
        max_tokens: at most this many tokens (rows x T) through the model in one pass (a row at
            least); a batch past it runs in several passes, the same scores.
        saes: SAEs or transcoders spliced in at their hooks (error kept), their latents and errors
            nodes of the graph (:func:`sae_graph`, which picks at most ``max_latents`` latents of each
            from these prompts). EAP and EAP-IG-inputs.
        graph: a graph from :func:`sae_graph` (the same latents for several calls), instead of ``saes``.
    Returns:
        :class:`EdgeScores` (float32, or float64 for a float64 model; on the model's device).
    """
    clean, corrupted = _check_inputs(model, clean, corrupted, metric)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"ig_steps must be an int >= 1, got {ig_steps!r}")
    if not isinstance(per_position, bool):
        raise TypeError(f"per_position must be a bool, got {per_position!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    graph = _graph_for(model, clean, corrupted, saes, max_latents, graph, max_tokens)
    if graph.saes and method == "EAP-IG-activations":
        raise ValueError("method='EAP-IG-activations' interpolates the model's own writers; with SAE nodes use EAP")
    steps = 1 if method == "EAP" else ig_steps
    T = clean.shape[1]
    acc = torch.promote_types(model.dtype, torch.float32)
    W, R = len(graph.writers), len(graph.readers)
    # the gradients are needed inside torch.inference_mode() too (a server runs in it); its tensors
    # cannot be saved for backward, so such prompts are copied out of it
    with torch.inference_mode(False), torch.enable_grad():
        clean, corrupted = (x.clone() if x.is_inference() else x for x in (clean, corrupted))
        out = torch.zeros((T, W, R) if per_position else (W, R), dtype=acc, device=clean.device)
        _scores(model, graph, clean, corrupted, metric, method, steps, per_position, out, max_tokens)
    return EdgeScores(graph, out, method, steps, per_position)


def _scores(
    model: nn.Module,
    graph: EdgeGraph,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable,
    method: str,
    steps: int,
    per_position: bool,
    out: Tensor,
    max_tokens: int,
) -> None:
    with eval_mode(model), _spliced(model, [s.sae for s in graph.saes]):
        clean_w, _ = _run_writers(model, graph, clean, max_tokens)
        args = (model, graph, clean, corrupted, metric, clean_w, steps, per_position, out, max_tokens)
        if method == "EAP":
            _eap(model, graph, corrupted, metric, clean_w, per_position, out, max_tokens)
        elif method == "EAP-IG-inputs":
            _ig_inputs(*args)
        else:
            _ig_activations(*args)
    out *= graph.valid.to(out.device)


def _graph_for(
    model: nn.Module, clean: Tensor, corrupted: Tensor, saes: object, max_latents: int, graph: object, max_tokens: int
) -> EdgeGraph:
    """The graph edge_attribution scores: the model's, :func:`sae_graph`'s of ``saes``, or ``graph`` checked."""
    if graph is None and saes:
        return sae_graph(model, saes, [(clean, corrupted)], max_latents, max_tokens=max_tokens)
    if graph is None:
        return EdgeGraph.of(model)
    if saes:
        raise ValueError("give saes or graph, not both (a graph from sae_graph holds its SAEs)")
    if not isinstance(graph, EdgeGraph):
        raise TypeError(f"graph must be an EdgeGraph (from sae_graph), got {type(graph).__name__}")
    if graph.shape != EdgeGraph.of(model).shape:
        raise ValueError("graph belongs to another model (its layers or heads differ)")
    return graph


def _recording(model: nn.Module, graph: EdgeGraph) -> tuple[_Writers, dict[str, Callable], list]:
    rec = _Writers(model, graph)
    return rec, rec.fns(), rec.torch_hooks()


def _eap(
    model: nn.Module,
    graph: EdgeGraph,
    corrupted: Tensor,
    metric: Callable,
    clean_w: Tensor,
    per_pos: bool,
    out: Tensor,
    max_tokens: int,
) -> Tensor:
    """One corrupted forward and backward: its writers' outputs and every reader's gradient."""
    B, T = corrupted.shape
    if max_tokens < B * T:  # the rows over several passes (see _passes), the writers from plain passes first
        corr_w, _ = _run_writers(model, graph, corrupted, max_tokens)
        delta = clean_w - corr_w

        def add(layer: int, g: Tensor, units: list) -> None:
            _add_layer(graph, layer, delta[units[0][1]], g, per_pos, out)

        _passes(model, graph, corrupted, metric, 1, 1, max_tokens, lambda units: ({}, None), add)
        return corr_w
    rec, fns, handles = _recording(model, graph)
    try:
        grads = _reader_grads(model, graph, corrupted, lambda logits: metric_with_gradient(metric, logits), fns)
    finally:
        for h in handles:
            h.remove()
    corr_w = rec.stacked()
    delta = clean_w - corr_w
    for layer, g in enumerate(grads):
        _add_layer(graph, layer, delta, g, per_pos, out)
    return corr_w


def _passes(
    model: nn.Module,
    graph: EdgeGraph,
    idx: Tensor,
    metric: Callable,
    n_runs: int,
    steps: int,
    max_tokens: int,
    changes: Callable[[list], tuple[dict, dict | None]],
    add: Callable[[int, Tensor, list], None],
) -> None:
    """The forward and backward of ``metric / steps`` for each of ``n_runs`` runs of ``idx (B, T)`` (what
    ``changes(units)`` sets on them: replacing hook functions and out_proj pre-hooks), ``max_tokens``
    tokens a pass. A pass holds *units* ``(run, rows)``; ``add(layer, g, units)`` takes each reader
    layer's gradients ``g``, the units' rows one after the other."""
    B, T = idx.shape
    per = max(1, max_tokens // T)  # rows a pass
    if per >= B:  # whole runs, several a pass: each run's metric on its own rows
        for lo in range(0, n_runs, per // B):
            units = [(j, slice(0, B)) for j in range(lo, min(n_runs, lo + per // B))]

            def objective(logits: Tensor, n: int = len(units)) -> Tensor:
                return sum(metric_with_gradient(metric, logits[i * B : (i + 1) * B]) for i in range(n)) / steps

            _grad_pass(model, graph, idx, units, objective, changes, add)
        return
    # A run's rows over several passes. The metric reads all its rows' logits together, but the rows
    # are independent: each pass follows the metric's gradient at the run's logits (plain passes first).
    chunks = _row_chunks(B, T, max_tokens)
    for j in range(n_runs):
        logits = torch.cat([_forward(model, idx[r], *changes([(j, r)])) for r in chunks])
        grad = _logits_grad(metric, logits) / steps
        del logits
        for r in chunks:
            objective = lambda logits, g=grad[r]: (logits * g).sum()
            _grad_pass(model, graph, idx, [(j, r)], objective, changes, add)


def _grad_pass(
    model: nn.Module, graph: EdgeGraph, idx: Tensor, units: list, objective: Callable, changes: Callable, add: Callable
) -> None:
    replace, out_proj = changes(units)
    x = torch.cat([idx[r] for _, r in units])
    for layer, g in enumerate(_reader_grads(model, graph, x, objective, replace, out_proj)):
        add(layer, g, units)


def _ig_inputs(
    model: nn.Module,
    graph: EdgeGraph,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable,
    clean_w: Tensor,
    steps: int,
    per_pos: bool,
    out: Tensor,
    max_tokens: int,
) -> Tensor:
    """EAP-IG on the inputs: the token embeddings at ``alpha = k / steps``, the steps as rows of a batch."""
    with torch.no_grad():  # (the blocks after the embedding are not run)
        chunks = _row_chunks(*clean.shape, max_tokens)
        e1, e0 = (torch.cat([activation_at(model, "hook_embed", idx[r]) for r in chunks]) for idx in (clean, corrupted))
    corr_w, _ = _run_writers(model, graph, corrupted, max_tokens)  # (B, T, W, d)
    delta = clean_w - corr_w

    def changes(units: list) -> tuple[dict, None]:
        alpha = [torch.tensor(k / steps, dtype=e0.dtype, device=e0.device) for k, _ in units]
        path = torch.cat([e0[r] + a * (e1[r] - e0[r]) for a, (_, r) in zip(alpha, units, strict=True)])
        return {"hook_embed": lambda x, hook: path}, None

    def add(layer: int, g: Tensor, units: list) -> None:
        # the scores are linear in the gradient: the steps of a pass (the same rows) add their share
        _add_layer(graph, layer, delta[units[0][1]], g.view(len(units), -1, *g.shape[1:]).sum(0), per_pos, out)

    _passes(model, graph, corrupted, metric, steps, steps, max_tokens, changes, add)
    return corr_w


def _ig_activations(
    model: nn.Module,
    graph: EdgeGraph,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable,
    clean_w: Tensor,
    steps: int,
    per_pos: bool,
    out: Tensor,
    max_tokens: int,
) -> Tensor:
    """EAP-IG on the activations: one writer layer at a time at ``alpha = k / steps`` on the corrupted
    run; the edges out of that layer read the mean gradient of its own runs. Every (layer, step) run
    is ``B`` rows of a batch, a few batches in all."""
    corr_w, _ = _run_writers(model, graph, corrupted, max_tokens)  # (B, T, W, d)
    delta = clean_w - corr_w
    # Each layer's own activations on both prompts: the embeddings, z before out_proj (a head's
    # output is linear in its z) and the MLP's output.
    acts = {k: _layer_acts(model, graph, idx, max_tokens) for k, idx in (("clean", clean), ("corrupted", corrupted))}
    L, H = graph.n_layers, graph.n_heads
    # group: (where its activation is replaced, the writers it holds)
    groups: list[tuple[str, slice]] = [("hook_embed", slice(0, 1))]
    for layer in range(L):
        h0 = graph.head_writer(layer)
        groups.append((f"z.{layer}", slice(h0, h0 + H)))
        groups.append((f"blocks.{layer}.hook_mlp_out", slice(h0 + H, h0 + H + 1)))
    jobs = [(g, k) for g in range(len(groups)) for k in range(steps)]

    def changes(units: list) -> tuple[dict, dict]:
        def interpolated(name: str, x: Tensor) -> Tensor:
            """``x`` with the rows of the units that interpolate ``name`` set on the path."""
            a0, a1 = acts["corrupted"][name], acts["clean"][name]
            x, at = x.clone(), 0
            for j, r in units:
                g, k = jobs[j]
                if groups[g][0] == name:
                    x[at : at + r.stop - r.start] = a0[r] + (k / steps) * (a1[r] - a0[r])
                at += r.stop - r.start
            return x

        names = {groups[jobs[j][0]][0] for j, _ in units}
        replace = {n: (lambda x, hook, n=n: interpolated(n, x)) for n in names if not n.startswith("z.")}
        z_names = [n for n in names if n.startswith("z.")]
        z_replace = {int(n[2:]): (lambda m, args, n=n: (interpolated(n, args[0]), *args[1:])) for n in z_names}
        return replace, z_replace

    def add(layer: int, g: Tensor, units: list) -> None:
        at = 0
        for j, r in units:
            rows = g[at : at + r.stop - r.start]
            _add_layer(graph, layer, delta[r], rows, per_pos, out, writers=groups[jobs[j][0]][1])
            at += r.stop - r.start

    _passes(model, graph, corrupted, metric, len(jobs), steps, max_tokens, changes, add)
    return corr_w


def _layer_acts(model: nn.Module, graph: EdgeGraph, idx: Tensor, max_tokens: int) -> dict[str, Tensor]:
    """The activations EAP-IG-activations interpolates, from plain forwards of ``idx``."""
    parts: dict[str, list[Tensor]] = {}

    def grab(x: Tensor, hook: HookPoint) -> None:
        parts.setdefault(hook.name, []).append(x.detach())

    def grab_z(layer: int) -> Callable:
        def pre(module: nn.Module, args: tuple) -> None:
            parts.setdefault(f"z.{layer}", []).append(args[0].detach())  # (B, T, H * hd)

        return pre

    names = ["hook_embed"] + [f"blocks.{i}.hook_mlp_out" for i in range(graph.n_layers)]
    out_proj = {i: grab_z(i) for i in range(graph.n_layers)}
    for rows in _row_chunks(*idx.shape, max_tokens):
        _forward(model, idx[rows], dict.fromkeys(names, grab), out_proj)
    return {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in parts.items()}


# --------------------------------------------------------------------------------------------
# Circuits: the model with the edges outside a circuit patched from the corrupted run
# --------------------------------------------------------------------------------------------
class _CircuitRun:
    """Hooks that run ``C`` circuits at once on the clean prompt (row ``c * B + b``): each reader's
    input is the live stream minus, for each edge left out, the writer's live output plus its
    corrupted one. ``D (C, W, B, T, d)`` holds each writer's live minus corrupted output as it runs."""

    def __init__(self, model: nn.Module, graph: EdgeGraph, corr_w: Tensor, excluded: Tensor) -> None:
        self.model, self.graph = model, graph
        self.C = excluded.shape[0]
        B, T, W, d = corr_w.shape
        self.B, self.T, self.d = B, T, d
        self.corr = corr_w.permute(2, 0, 1, 3)  # (W, B, T, d)
        self.E = excluded.transpose(-1, -2).to(corr_w.dtype)  # (C, R, W) or (C, T, R, W): 1 = patched
        self.per_pos = excluded.dim() == 4
        self.D = corr_w.new_zeros(self.C, W, B, T, d)
        self.state: dict[str, Tensor | None] = {}

    def _rows(self, x: Tensor) -> Tensor:
        return x.view(self.C, self.B, self.T, -1)  # (C, B, T, ...)

    def _spans(self, w_hi: int) -> list[tuple[int, int]]:
        """The writers a reader may read: the model's up to ``w_hi``, and the SAEs' (listed after them)."""
        g = self.graph
        if not g.saes:
            return [(0, w_hi)]
        return [(0, min(w_hi, g.n_base_writers)), (g.n_base_writers, len(g.writers))]

    def _patched(self, lo: int, hi: int, w_hi: int) -> bool:
        return any(bool(self.E[..., lo:hi, a:b].any()) for a, b in self._spans(w_hi))

    def _corrections(self, lo: int, hi: int, w_hi: int) -> Tensor:
        """``(C, hi - lo, B, T, d)``: what readers ``lo:hi`` take off their live input."""
        out = 0
        for a, b in self._spans(w_hi):
            D = self.D[:, a:b]  # (C, w, B, T, d)
            if self.per_pos:
                out = out + torch.einsum("ctrw,cwbtd->crbtd", self.E[:, :, lo:hi, a:b], D)
            else:
                e = self.E[:, lo:hi, a:b]  # (C, r, w)
                out = out + (e @ D.reshape(self.C, b - a, -1)).view(self.C, hi - lo, self.B, self.T, self.d)
        return out

    def fns(self) -> dict[str, Callable]:
        fns: dict[str, Callable] = {}
        replaced = {s.layer for s in self.graph.saes if not s.has_input}  # MLPs whose output an SAE replaces
        for layer in range(self.graph.n_layers):
            fns[f"blocks.{layer}.hook_resid_pre"] = self._resid_pre(layer)
            fns[f"blocks.{layer}.attn.hook_q"] = self._q(layer)
            fns[f"blocks.{layer}.attn.hook_k"] = self._kv("k")
            fns[f"blocks.{layer}.attn.hook_v"] = self._kv("v")
            if not self.graph.parallel:  # (a parallel block has no resid_mid)
                fns[f"blocks.{layer}.hook_resid_mid"] = self._mid
            if layer not in replaced:
                fns[f"blocks.{layer}.hook_mlp_out"] = self._mlp(layer)
        for i, s in enumerate(self.graph.saes):  # hook points while the SAEs are spliced in
            if s.place != "mlp_out":
                fns[sae_point(s.sae, "input")] = self._sae_input(i)
            else:
                fns[sae_point(s.sae, "input")] = lambda x, hook: self.state.__setitem__(hook.name, x)
            fns[sae_point(s.sae, "acts_post")] = lambda x, hook: self.state.__setitem__(hook.name, x)
            fns[sae_point(s.sae, "output")] = self._sae_output(i)
        return fns

    def torch_hooks(self) -> list:
        handles = [self.model.final_norm.register_forward_pre_hook(self._final)]
        for layer, block in enumerate(self.model.trf_blocks):
            handles.append(block.att.out_proj.register_forward_pre_hook(self._heads(layer)))
        for s in self.graph.saes:
            if s.place == "mlp_out":  # the MLP reads its patched input; the SAE then reads the MLP's output
                handles.append(self.model.trf_blocks[s.layer].norm2.register_forward_pre_hook(self._mlp_in(s.layer)))
        return handles

    def _mlp_in(self, layer: int) -> Callable:
        g = self.graph
        r = g.reader_start(layer) + g.readers_per_layer - 1
        w_hi = g.head_writer(layer) + (0 if g.parallel else g.n_heads)  # up to its own layer's heads

        def pre(module: nn.Module, args: tuple) -> tuple | None:
            if not self._patched(r, r + 1, w_hi):
                return None
            x = self._rows(args[0]) - self._corrections(r, r + 1, w_hi)[:, 0]  # (C, B, T, d)
            return (x.reshape(args[0].shape), *args[1:])

        return pre

    def _sae_input(self, i: int) -> Callable:
        """What a residual SAE or a transcoder reads: its live input less its patched edges (its error
        stays the live run's: an edge into the SAE changes its latents)."""
        g, s = self.graph, self.graph.saes[i]
        r = g.sae_reader(i)

        def fn(x: Tensor, hook: HookPoint) -> Tensor:
            if s.place == "resid_pre" and s.layer == 0:
                self.D[:, 0] = self._rows(x) - self.corr[0]  # the embeddings: what this SAE reads
            if self._patched(r, r + 1, g.n_base_writers):
                x = (self._rows(x) - self._corrections(r, r + 1, g.n_base_writers)[:, 0]).reshape(x.shape)
            self.state[hook.name] = x
            return x

        return fn

    def _sae_output(self, i: int) -> Callable:
        s, sl = self.graph.saes[i], self.graph.sae_writers(i)

        def fn(y: Tensor, hook: HookPoint) -> None:
            x, z = (self.state[sae_point(s.sae, p)] for p in ("input", "acts_post"))
            live = sae_parts(s, x, z, y).view(self.C, self.B, self.T, -1, self.d).permute(0, 3, 1, 2, 4)
            self.D[:, sl] = live - self.corr[sl]

        return fn

    def _resid_pre(self, layer: int) -> Callable:
        def fn(x: Tensor, hook: HookPoint) -> None:
            self.state["x"] = self._rows(x)  # (C, B, T, d)
            if layer == 0:
                self.D[:, 0] = self.state["x"] - self.corr[0]

        return fn

    def _q(self, layer: int) -> Callable:
        g, att = self.graph, self.model.trf_blocks[layer].att
        H, G, hd = g.n_heads, g.n_kv_heads, att.head_dim
        lo, w_hi = g.reader_start(layer), g.head_writer(layer)
        hi = lo + H + 2 * G

        def project(y: Tensor, lin: nn.Module, n: int) -> Tensor:
            """Head ``i`` of ``lin`` on its own input ``y[:, i]``: ``(C, n, B, T, d)`` -> ``(C B, T, n, hd)``."""
            out = torch.einsum("cnbtd,ned->cbtne", y, _dense(lin.weight).view(n, hd, -1))
            if lin.bias is not None:
                out = out + lin.bias.view(n, hd)
            return out.reshape(self.C * self.B, self.T, n, hd)

        def fn(q: Tensor, hook: HookPoint) -> Tensor | None:
            self.state["k"] = self.state["v"] = None
            if not self._patched(lo, hi, w_hi):
                return None
            inputs = self.state["x"][:, None] - self._corrections(lo, hi, w_hi)  # (C, H + 2G, B, T, d)
            y = self.model.trf_blocks[layer].norm1(inputs)
            self.state["k"] = project(y[:, H : H + G], att.W_key, G)
            self.state["v"] = project(y[:, H + G :], att.W_value, G)
            return project(y[:, :H], att.W_query, H)

        return fn

    def _kv(self, which: str) -> Callable:
        def fn(x: Tensor, hook: HookPoint) -> Tensor | None:
            return self.state[which]

        return fn

    def _heads(self, layer: int) -> Callable:
        att, h0 = self.model.trf_blocks[layer].att, self.graph.head_writer(layer)

        def pre(module: nn.Module, args: tuple) -> None:
            live = head_results(att, args[0]).view(self.C, self.B, self.T, -1, self.d)  # (C, B, T, H, d)
            self.D[:, h0 : h0 + att.num_heads] = live.permute(0, 3, 1, 2, 4) - self.corr[h0 : h0 + att.num_heads]

        return pre

    def _mid(self, x: Tensor, hook: HookPoint) -> None:
        self.state["mid"] = self._rows(x)

    def _mlp(self, layer: int) -> Callable:
        g, block = self.graph, self.model.trf_blocks[layer]
        r = g.reader_start(layer) + g.readers_per_layer - 1
        w = g.head_writer(layer) + g.n_heads  # this MLP's writer index
        w_hi = g.head_writer(layer) if g.parallel else w  # a parallel MLP does not read its layer's heads

        def fn(out: Tensor, hook: HookPoint) -> Tensor | None:
            new = None
            if self._patched(r, r + 1, w_hi):
                base = self.state["x" if g.parallel else "mid"]
                inputs = base - self._corrections(r, r + 1, w_hi)[:, 0]  # (C, B, T, d)
                new = block.ff(block.norm2(inputs)).reshape(out.shape)
            live = out if new is None else new
            self.D[:, w] = self._rows(live) - self.corr[w]
            return new

        return fn

    def _final(self, module: nn.Module, args: tuple) -> tuple | None:
        r, W = self.graph.logits_reader, len(self.graph.writers)
        if not self._patched(r, r + 1, W):
            return None
        x = self._rows(args[0]) - self._corrections(r, r + 1, W)[:, 0]  # (C, B, T, d)
        return (x.reshape(args[0].shape), *args[1:])


def _as_masks(model_graph: EdgeGraph, circuits: object, T: int) -> tuple[EdgeGraph, Tensor]:
    """``circuits`` (one :class:`Circuit` or a sequence) as ``(C, W, R)`` or ``(C, T, W, R)`` kept-masks,
    and their graph (the model's, with the SAE nodes of :func:`sae_graph` if they have them)."""
    listed = [circuits] if isinstance(circuits, Circuit) else circuits
    if not isinstance(listed, (list, tuple)) or not listed or not all(isinstance(c, Circuit) for c in listed):
        raise TypeError(f"circuits must be a Circuit or a non-empty list of them, got {type(circuits).__name__}")
    graph = listed[0].graph if listed[0].graph.saes else model_graph
    shapes = {tuple(c.mask.shape) for c in listed}
    if len(shapes) != 1:
        raise ValueError(f"circuits must all be position-summed or all per position, got mask shapes {sorted(shapes)}")
    for c in listed:
        if c.graph.shape != graph.shape:
            raise ValueError("a circuit belongs to another model's graph (its layers or heads differ)")
        if c.mask.dim() == 3 and c.mask.shape[0] != T:
            raise ValueError(f"a per-position circuit has {c.mask.shape[0]} positions, the prompts have {T}")
    if not all(c.graph.same_nodes(graph) for c in listed):
        raise ValueError("the circuits must all belong to one graph (the same SAE latents)")
    return graph, torch.stack([c.mask for c in listed])


def circuit_metrics(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable[[Tensor], Tensor],
    circuits: Circuit | Sequence[Circuit],
    *,
    max_tokens: int = 8192,
) -> list[float]:
    """The metric of the clean prompt with every edge outside each circuit patched from the corrupted run.

    The circuits run together as the rows of a few batches, ``max_tokens`` tokens a pass (a row at
    least: a batch of prompts past it runs in several passes, the metric reading all their logits).
    The full circuit gives ``metric(model(clean))`` and the empty one ``metric(model(corrupted))``.

    Circuits of a graph with SAE nodes (:func:`sae_graph`) run with those SAEs spliced in: an edge
    left out of a latent or error node carries its corrupted output; an edge left out into a residual
    SAE's input or a transcoder changes its latents (its error term stays the live run's).
    """
    clean, corrupted = _check_inputs(model, clean, corrupted, metric)
    graph, masks = _as_masks(EdgeGraph.of(model), circuits, clean.shape[1])
    return _circuit_values(model, graph, masks, clean, corrupted, metric, max_tokens)


def _circuit_values(
    model: nn.Module,
    graph: EdgeGraph,
    masks: Tensor,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable,
    max_tokens: int,
) -> list[float]:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    masks = masks.to(clean.device)
    B, T = clean.shape
    chunks = _row_chunks(B, T, max_tokens)
    per = max(1, max_tokens // (B * T))  # circuits a pass (one when its rows take several)
    values: list[float] = []
    with eval_mode(model), _spliced(model, [s.sae for s in graph.saes]):
        corr_w, _ = _run_writers(model, graph, corrupted, max_tokens)
        for lo in range(0, masks.shape[0], per):
            kept = masks[lo : lo + per]
            excluded = graph.valid.to(kept.device) & ~kept
            parts = [_patched_run(model, graph, corr_w[r], excluded, clean[r]) for r in chunks]
            logits = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (C, B, T, V)
            for c in range(kept.shape[0]):
                value = finite_metric(metric_scalar(metric(logits[c])), logits[c], f"for circuits[{lo + c}]")
                values.append(float(value))
    return values


def _patched_run(model: nn.Module, graph: EdgeGraph, corr_w: Tensor, excluded: Tensor, clean: Tensor) -> Tensor:
    """The logits ``(C, B, T, V)`` of ``clean (B, T)`` with each circuit's ``excluded`` edges patched."""
    run = _CircuitRun(model, graph, corr_w, excluded)
    handles = run.torch_hooks()
    try:
        with torch.no_grad(), hooks(model, run.fns()):
            logits = model(clean.repeat(excluded.shape[0], 1))  # (C B, T, V)
    finally:
        for h in handles:
            h.remove()
    return logits.view(excluded.shape[0], *clean.shape, -1)


def faithfulness(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable[[Tensor], Tensor],
    circuits: Circuit | Sequence[Circuit],
    *,
    max_tokens: int = 8192,
) -> list[float]:
    """MIB's faithfulness of each circuit: ``(m(C) - m(corrupted)) / (m(clean) - m(corrupted))``, 1 for
    the full model, 0 for the empty circuit (TransformerLens 4.3's ``recovered``).

    ``m(clean)`` and ``m(corrupted)`` are the whole model's metric on each prompt, run as the full and
    the empty circuit beside the others (the same sums: the full circuit's faithfulness is 1, up to
    the rounding of the pass it runs in); a ValueError when they are equal (the ratio is undefined).
    """
    clean, corrupted = _check_inputs(model, clean, corrupted, metric)
    values, m_clean, m_corr = _with_endpoints(model, clean, corrupted, metric, circuits, max_tokens)
    return [(v - m_corr) / (m_clean - m_corr) for v in values]


def _with_endpoints(
    model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Callable, circuits: object, max_tokens: int
) -> tuple[list[float], float, float]:
    """Each circuit's metric, and ``m(clean)``, ``m(corrupted)``: the full and the empty circuit's."""
    graph, masks = _as_masks(EdgeGraph.of(model), circuits, clean.shape[1])
    full = graph.valid.expand_as(masks[0])
    masks = torch.cat([masks, torch.stack([full, torch.zeros_like(full)])])
    *values, m_clean, m_corr = _circuit_values(model, graph, masks, clean, corrupted, metric, max_tokens)
    if m_clean == m_corr:
        raise ValueError(
            f"the metric is {m_clean} on both prompts, so faithfulness (a fraction of the difference) is undefined; "
            "choose a pair the metric separates"
        )
    return values, m_clean, m_corr


@dataclass(frozen=True)
class FaithfulnessCurve:
    """Faithfulness at MIB's edge budgets and its summaries.

    ``budgets``: fractions of all edges; ``n_edges``: ``int(budget * total)`` (MIB's count);
    ``faithfulness``: one value per budget; ``cpr``: the area under the curve, ``cmd``: the area
    between it and 1 (trapezoids over the budgets' fractions, as MIB's ``evaluate_area_under_curve``).
    """

    budgets: tuple[float, ...]
    n_edges: tuple[int, ...]
    faithfulness: tuple[float, ...]
    cpr: float
    cmd: float
    clean_metric: float
    corrupted_metric: float


def areas(budgets: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """``(CPR, CMD)``: trapezoid areas under ``values`` and between ``values`` and 1, over ``budgets``."""
    cpr = cmd = 0.0
    for i in range(len(values) - 1):
        dx, f1, f2 = budgets[i + 1] - budgets[i], values[i], values[i + 1]
        cpr += dx * (f1 + f2) / 2
        cmd += dx * (abs(1 - f1) + abs(1 - f2)) / 2
    return cpr, cmd


def faithfulness_curve(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable[[Tensor], Tensor],
    scores: EdgeScores,
    budgets: Sequence[float] = MIB_BUDGETS,
    select: str = "top_n",
    *,
    max_tokens: int = 8192,
) -> FaithfulnessCurve:
    """The faithfulness of the circuit of ``scores``' best edges at each budget (``"top_n"`` or ``"greedy"``)."""
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores must be the EdgeScores of edge_attribution, got {type(scores).__name__}")
    if select not in ("top_n", "greedy"):
        raise ValueError(f"select must be 'top_n' or 'greedy', got {select!r}")
    fractions = list(budgets) if isinstance(budgets, (list, tuple)) else None
    ok = fractions and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b <= 1 for b in fractions)
    if not ok or fractions != sorted(fractions):
        raise ValueError(f"budgets must be increasing fractions of the edges in (0, 1], got {budgets!r}")
    total = len(scores)
    counts = [int(b * total) for b in fractions]
    circuits = [getattr(scores, select)(n) for n in counts]
    clean, corrupted = _check_inputs(model, clean, corrupted, metric)
    values, m_clean, m_corr = _with_endpoints(model, clean, corrupted, metric, circuits, max_tokens)
    faith = [(v - m_corr) / (m_clean - m_corr) for v in values]
    cpr, cmd = areas(fractions, faith)
    return FaithfulnessCurve(tuple(fractions), tuple(counts), tuple(faith), cpr, cmd, m_clean, m_corr)
