"""The decoding methods: for each, the draft heads it takes and the shape of what it drafts (one
class a method). A method's tree is a sequence of layers (:meth:`Method.schedule`), each of one of
the :data:`LAYER_KINDS`; the drafter (:mod:`jakiro_ext.engine.drafter`) implements each kind once
and the tree cost model (:mod:`jakiro_ext.engine.tree_cost`) reads the same schedule, so neither
knows a method by name. Adding a method adds a class here (and, if it drafts a layer in a new way,
that kind of layer to the drafter and to :meth:`Method.node_probabilities`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from jakiro_ext.models.heads.config import KINDS, MLP_HEAD_KINDS, MOE_KINDS


class MethodName(str, enum.Enum):
    """The methods' public names; each equals its string (``MethodName.JAKIRO == "jakiro"``)."""
    AR = "ar"
    EAGLE2 = "eagle2"
    JAKIRO = "jakiro"
    JAKIRO_STAR = "jakiro_star"
    GUMIHO = "gumiho"

    def __str__(self) -> str:
        return self.value


# The head kinds (DraftConfig.kind) a method can take, by the layers they have.
ANY_HEAD = (*KINDS, "eagle3")

# The kinds of a tree's layers (of the children each node of the layer above gets):
SERIAL = "serial"  # from a draft forward's feature of each frontier node (EAGLE-2)
EXPERTS = "experts"  # from each of the two activated experts' own feature, the repeats dropped (Jakiro*)
CONTRASTIVE = "contrastive"  # two tokens ahead, from the MoE's contrastive feature of the forward before,
# under each frontier node's best child: no forward of its own (Jakiro's parallel last step)
MLP = "mlp"  # from one of the head's parallel MLP heads, all in one pass after the serial layers (Gumiho)
LAYER_KINDS = (SERIAL, EXPERTS, CONTRASTIVE, MLP)
FORWARD_KINDS = (SERIAL, EXPERTS)  # the kinds that take a draft forward over the frontier


def _prob(table: Sequence[Sequence[float]], row: int, rank: int) -> float:
    """``table[row][rank]`` where the table has it, else 0."""
    return float(table[row][rank]) if 0 <= row < len(table) and rank < len(table[row]) else 0.0


@dataclass(frozen=True)
class Method:
    """A decoding method, as plain decoding: it drafts nothing (the one-node tree, the root alone).

    heads : the head kinds it drafts with (empty: plain decoding); ``needs`` says what they are,
        for the error when the head is another kind.
    shipped_head : the kind of the shipped head the command line loads for it.
    default_for : the head kinds it is the method of when none is given.
    """
    name: str  # a MethodName's value
    heads: Tuple[str, ...] = ()
    needs: str = ""
    shipped_head: Optional[str] = None
    default_for: Tuple[str, ...] = ()

    @property
    def drafts(self) -> bool:
        """Whether it drafts with a head (all but plain decoding)."""
        return bool(self.heads)

    def schedule(self, depth: int, mlp_heads: int = 0) -> Tuple[str, ...]:
        """The kinds of a dynamic tree's layers of drafted nodes, the root's children first: one
        more than ``depth`` (EAGLE-2's convention: a path holds up to depth + 1 drafted tokens).
        ``mlp_heads``: the head's parallel MLP heads."""
        return ()

    def children(self, top_k: int) -> int:
        """Candidates drafted per expanded node."""
        return top_k

    def max_nodes(self, tree) -> int:
        """The most nodes one round of a :class:`TreeConfig` ``tree`` can verify, the root included
        (what the KV caches are sized by). A static tree has its nodes. A dynamic tree keeps at
        most ``total_tokens``, and can't draft more than c children of the root plus, per
        expansion, c children of each of its ``top_k`` frontier nodes (c: :meth:`children`)."""
        if not self.drafts:
            return 1
        if tree.choices is not None:
            return len({tuple(p) for p in tree.choices}) + 1
        c = self.children(tree.top_k)
        return min(tree.total_tokens, 1 + c + tree.depth * tree.top_k * c)

    def min_depth(self, mlp_heads: int) -> int:
        """The least depth of its dynamic trees (``mlp_heads``: the head's parallel MLP heads)."""
        return 1

    def check(self, head_kind: str, mlp_heads: int, tree) -> None:
        """What the method asks of the head (its ``head_kind``, ``mlp_heads``) and the tree: a
        ValueError naming what is unmet."""
        if head_kind not in self.heads:
            raise ValueError(f"method {self.name!r} needs {self.needs}; this head is {head_kind!r}")

    def node_probabilities(self, profile: dict, depth: int, top_k: int) -> List[float]:
        """The probability that each node a dynamic tree of ``depth`` and ``top_k`` can draft is
        accepted, best first (the drafter's own rule with the head's acceptance profile as the
        scores: the ``top_k`` best nodes of a layer get ``top_k`` children each; a node is accepted
        when its whole path is): a tree of N tokens keeps the first N - 1. ``profile``:
        {"depth_rank": [[p(d=1, r=0), p(1, 1), ...], [p(2, 0), ...], ...]}, the probability that the
        target's token at depth d is the draft's r-th candidate given the path before it was right;
        "contrastive_depth_rank" the same for the contrastive step from depth 2 on; "mlp_depth_rank"
        one row per MLP head."""
        p = profile["depth_rank"]
        kinds = self.schedule(depth, len(profile.get("mlp_depth_rank", ())))
        nodes: List[float] = []
        layer, frontier, mlp = [1.0], [1.0], 0
        for d, kind in enumerate(kinds, 1):
            if kind == CONTRASTIVE:  # under the best child of each node of the last frontier
                pc = profile.get("contrastive_depth_rank")
                if pc is not None:  # (a profile without it: the step's nodes are not counted)
                    nodes += [v * _prob(p, d - 2, 0) * _prob(pc, d - 2, r) for v in frontier for r in range(top_k)]
                continue
            frontier = sorted(layer, reverse=True)[:top_k]
            table, row = (profile["mlp_depth_rank"], mlp) if kind == MLP else (p, d - 1)
            mlp += kind == MLP
            layer = [v * _prob(table, row, r) for v in frontier for r in range(top_k)]
            nodes += layer
        return sorted(nodes, reverse=True)


@dataclass(frozen=True)
class Eagle2(Method):
    """EAGLE-2's dynamic tree, drafted autoregressively from the head's feature, or a static tree."""

    def schedule(self, depth: int, mlp_heads: int = 0) -> Tuple[str, ...]:
        return (SERIAL,) * (depth + 1)


@dataclass(frozen=True)
class Jakiro(Eagle2):
    """The last tree layer comes from the MoE's contrastive feature (two tokens ahead) in the same
    forward as the layer before it: one draft forward fewer (at depth 1, none but the catch-up's:
    the root's step gives both layers)."""

    def schedule(self, depth: int, mlp_heads: int = 0) -> Tuple[str, ...]:
        return (SERIAL,) * depth + (CONTRASTIVE,)

    def check(self, head_kind: str, mlp_heads: int, tree) -> None:
        super().check(head_kind, mlp_heads, tree)
        if tree.choices is not None:
            raise ValueError(f"method {self.name!r} (hybrid contrastive last step) builds the dynamic tree; "
                             "with a static tree use 'eagle2' or 'jakiro_star'")


@dataclass(frozen=True)
class JakiroStar(Eagle2):
    """Each of the two activated experts proposes its own children; the best are kept."""

    def schedule(self, depth: int, mlp_heads: int = 0) -> Tuple[str, ...]:
        return (EXPERTS,) * (depth + 1)

    def children(self, top_k: int) -> int:
        return 2 * top_k  # (both experts' proposals)


@dataclass(frozen=True)
class Gumiho(Eagle2):
    """Serial layers draft the first tree layers, then the head's parallel MLP heads draft every
    later layer in one pass."""

    def schedule(self, depth: int, mlp_heads: int = 0) -> Tuple[str, ...]:
        return (SERIAL,) * (depth + 1 - mlp_heads) + (MLP,) * mlp_heads

    def min_depth(self, mlp_heads: int) -> int:
        return mlp_heads + 1  # the serial part's first step, then one layer per MLP head

    def check(self, head_kind: str, mlp_heads: int, tree) -> None:
        super().check(head_kind, mlp_heads, tree)
        if tree.choices is not None:
            raise ValueError(f"method {self.name!r} (parallel MLP heads) builds the dynamic tree; with a static tree "
                             "use 'eagle2'")
        if tree.depth < self.min_depth(mlp_heads):
            raise ValueError(f"method {self.name!r} drafts at least one serial step before the head's "
                             f"{mlp_heads} MLP heads and needs depth >= {self.min_depth(mlp_heads)}, got {tree.depth}")


METHODS = {m.name: m for m in (
    Method(MethodName.AR.value),
    Eagle2(MethodName.EAGLE2.value, ANY_HEAD, "a draft head", "eagle2", default_for=("eagle2", "eagle3")),
    Jakiro(MethodName.JAKIRO.value, MOE_KINDS, "a Jakiro (MoE) draft head", "jakiro", default_for=("jakiro",)),
    JakiroStar(MethodName.JAKIRO_STAR.value, MOE_KINDS, "a Jakiro (MoE) draft head", "jakiro"),
    Gumiho(MethodName.GUMIHO.value, MLP_HEAD_KINDS, "a Gumiho draft head (MLP heads: gumiho or jakiro_gumiho)",
           "gumiho", default_for=("gumiho", "jakiro_gumiho")),
)}
METHOD_NAMES = tuple(METHODS)  # ("ar", "eagle2", "jakiro", "jakiro_star", "gumiho")
BASELINE = MethodName.AR.value  # plain decoding: what every speedup is measured against


def method_for_head(kind: Optional[str]) -> Method:
    """The method a head of ``kind`` decodes with when none is given (None: no head, ``ar``)."""
    if kind is None:
        return METHODS["ar"]
    for method in METHODS.values():
        if kind in method.default_for:
            return method
    raise ValueError(f"no method drafts with a {kind!r} head (kinds: {ANY_HEAD})")
