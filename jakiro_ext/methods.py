"""The decoding methods, as data: for each, the draft heads it takes, how it drafts its tree, and
what the tree cost model reads from a head's acceptance profile. Adding a method adds an entry to
``METHODS`` and, if it drafts in a new way, that way to :mod:`jakiro_ext.engine.drafter`."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

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


@dataclass(frozen=True)
class Method:
    """What a decoding method asks of the draft side.

    heads : the head kinds it drafts with (empty: plain decoding drafts the one-node tree, the
        root alone); ``needs`` says what they are, for the error when the head is another kind.
    shipped_head : the kind of the shipped head the command line loads for it.
    default_for : the head kinds it is the method of when none is given.
    hybrid_last_layer : the last tree layer comes from the MoE's contrastive feature (two tokens
        ahead) in the same forward as the layer before it: one draft forward fewer (Jakiro).
    children_per_expert : each of the two activated experts proposes its own children (Jakiro*).
    parallel_heads : the last tree layers come from the head's MLP heads, one per layer, all in
        one pass after the serial expansions (Gumiho).
    The cost model reads the head's profile "depth_rank" for the serial layers, and for the
    hybrid last layer "contrastive_depth_rank", for the parallel ones "mlp_depth_rank".
    """
    name: str  # a MethodName's value
    heads: Tuple[str, ...] = ()
    needs: str = ""
    shipped_head: Optional[str] = None
    default_for: Tuple[str, ...] = ()
    hybrid_last_layer: bool = False
    children_per_expert: bool = False
    parallel_heads: bool = False

    @property
    def drafts(self) -> bool:
        """Whether it drafts with a head (all but plain decoding)."""
        return bool(self.heads)

    def children(self, top_k: int) -> int:
        """Candidates drafted per expanded node."""
        return 2 * top_k if self.children_per_expert else top_k

    def extra_layers(self, head) -> int:
        """Tree layers drafted beyond the serial expansions: the hybrid step's one, or one per MLP head."""
        if self.hybrid_last_layer:
            return 1
        return getattr(head.config, "num_mlp_heads", 0) if self.parallel_heads else 0


METHODS = {m.name: m for m in (
    Method(MethodName.AR.value),
    Method(MethodName.EAGLE2.value, ANY_HEAD, "a draft head", "eagle2", default_for=("eagle2", "eagle3")),
    Method(MethodName.JAKIRO.value, MOE_KINDS, "a Jakiro (MoE) draft head", "jakiro", default_for=("jakiro",),
           hybrid_last_layer=True),
    Method(MethodName.JAKIRO_STAR.value, MOE_KINDS, "a Jakiro (MoE) draft head", "jakiro", children_per_expert=True),
    Method(MethodName.GUMIHO.value, MLP_HEAD_KINDS, "a Gumiho draft head (MLP heads: gumiho or jakiro_gumiho)", "gumiho",
           default_for=("gumiho", "jakiro_gumiho"), parallel_heads=True),
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
