"""The draft side of a round, for a batch of sequences: the :class:`Drafter` that runs the draft
head and grows each sequence's tree (:mod:`jakiro_ext.engine.tree`) one of two ways (dynamic:
EAGLE-2's best-first expansion, its layers those of the method's schedule; static: a fixed list of
child-rank paths). Each row of a batch is computed exactly as it is alone.
"""
from __future__ import annotations

from typing import Optional

import torch

from jakiro_ext import ops
from jakiro_ext.engine import draft_lag
from jakiro_ext.engine.tree import DraftTree, VerifyTree
from jakiro_ext.kv_cache import BufferPool, KVCache, TreeKV
from jakiro_ext.methods import CONTRASTIVE, EXPERTS, FORWARD_KINDS, MLP, Method
from jakiro_ext.models.heads.head import Head
from jakiro_ext.models.heads.step import DraftStep, take_rows
from jakiro_ext.models.llama import PREFILL_CHUNK
from jakiro_ext.ops.masks import causal_tree_mask, diagonal_mask

# What can go wrong in drafting, found on the device (VerifyTree.errors, in this order): the
# round raises the message when it reads its accepted tokens, before anything is emitted.
DRAFT_ERRORS = ("the draft head produced non-finite logits (NaN or inf): no token can be drafted "
                "(check the head's weights)",
                "a draft tree with only its root cannot be padded (no child to repeat)")


def dedupe(logprobs: torch.Tensor, ids: torch.Tensor):
    """Sort candidate rows [R, C] by log-probability and set repeated tokens (two experts
    proposing the same one) to -inf, so a token is never two siblings."""
    logprobs, order = logprobs.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    # A token's first (most probable) occurrence stays. Sorted by id (stably: occurrences keep
    # their probability order), a repeat comes right after an earlier occurrence: O(C log C) a
    # row, not a [R, C, C] comparison.
    by_id, position = ids.sort(dim=-1, stable=True)
    later = torch.zeros_like(by_id, dtype=torch.bool)
    later[..., 1:] = by_id[..., 1:] == by_id[..., :-1]
    repeated = torch.zeros_like(later).scatter(-1, position, later)
    # Sort again so the dropped repeats go last: a child's rank is its rank among distinct tokens.
    logprobs, order = logprobs.masked_fill(repeated, float("-inf")).sort(dim=-1, descending=True, stable=True)
    return logprobs, ids.gather(-1, order)


class Drafter:
    """The draft head's side of a round: the catch-up forward over the accepted tokens and tree
    building. It holds no sequence's state: the draft's KV cache (committed up to each sequence's
    last emitted token) and the root step (each sequence's latest catch-up output, which predicts
    the next tree's first layer) are the batch state's (:class:`jakiro_ext.engine.state.BatchState`)
    and come in as arguments. With a method that drafts nothing (plain decoding) it drafts the
    one-node tree, the root alone."""

    def __init__(self, head: Optional[Head], method: Method, tree, rows: int = 1):
        """``rows``: the most batch rows it drafts for (the draft's catch-up window, :func:`draft_lag.window`)."""
        self.head, self.method, self.tree = head, method, tree
        self.forwards = 0
        self._plan: Optional[list] = None  # a static tree's index tensors (_static_plan)
        self._errors: Optional[torch.Tensor] = None  # the round's DRAFT_ERRORS flags
        self._masks: dict = {}  # (_mask) the masks of a round's shapes
        self._lm_head: Optional[torch.Tensor] = None  # the round's draft LM head (DraftHead.products)
        self._fixed_trees: dict = {}  # (_fixed_tree) the parts of trees of a fixed shape, per shape, on the CPU
        self.drafts = self.check(head, method, tree)
        # The kinds of the tree's layers (methods.LAYER_KINDS), the root's children first.
        self.schedule = method.schedule(tree.depth if tree.choices is None else max(map(len, tree.choices)) - 1,
                                        getattr(head.config, "num_mlp_heads", 0)) if self.drafts else ()
        # Beyond the committed tokens, a tree layer's rows need scratch slots (at most the
        # frontier: top_k nodes, or a whole static layer), a catch-up after a round at most the
        # tree, and one on what plain rounds left behind, up to a window of pairs: one forward (in
        # forwards of a small tree's width, 32 pairs beside the Q4_1 target took 8 and 12 ms).
        self.max_nodes = tree.max_nodes_for(method) if self.drafts else 1  # a round's nodes, the root's included
        self.window = draft_lag.window(rows)
        self.scratch = max(tree.top_k, self.max_nodes, self.window) if self.drafts else 0

    @staticmethod
    def check(head: Optional[Head], method: Method, tree) -> bool:
        """The method's needs of the head and the tree (a ValueError if unmet); whether it drafts at all."""
        if not method.drafts:
            return False
        if head is None:
            raise ValueError(f"method {method.name!r} needs a draft head")
        if head.lm_head_weight is None:
            raise ValueError("the draft head is not bound to a target: call head.bind(target) (DraftHead.load does it)")
        method.check(head.config.kind, getattr(head.config, "num_mlp_heads", 0), tree)
        vocab = head.lm_head_weight.shape[0]
        width = _width(tree)
        if width > vocab:
            what = "children drafted per node" if tree.choices is None else "a static tree's widest child rank + 1"
            raise ValueError(f"the tree's top_k ({what}) is {width}, more than the draft vocabulary of the head "
                             f"({vocab} tokens)")
        return True

    @property
    def longest_path(self) -> int:
        """The most new tokens a round of its trees can give a sequence (its longest path: the
        root, one node for each layer of the schedule; 1 when nothing is drafted)."""
        return min(self.max_nodes, len(self.schedule) + 1)

    @property
    def width(self) -> int:
        """Candidates asked of the LM head per node (per expert for Jakiro*)."""
        return _width(self.tree)

    # ------------------------------------------------------------------ the committed side
    def new_cache(self, batch: int, capacity: int, max_capacity: Optional[int] = None,
                  pool: Optional[BufferPool] = None) -> Optional[KVCache]:
        """The draft's KV cache for ``batch`` sequences of ``capacity`` committed positions (growing
        up to ``max_capacity``; default: fixed), with the scratch a round's drafting writes beyond
        them (its buffers from ``pool`` where it keeps them); None when nothing is drafted."""
        if not self.drafts:
            return None
        return self.head.new_cache(capacity + self.scratch, None if max_capacity is None else max_capacity + self.scratch,
                                   batch=batch, pool=pool)

    def catch_up(self, cache: KVCache, tokens: torch.Tensor, features: torch.Tensor) -> DraftStep:
        """Run the pairs (tokens[b, i], features[b, i]) (token t+1 with the target's feature at t;
        [B, n] and [B, n, H]) after each sequence's committed prefix in ``cache``: their keys and
        values are written there uncommitted (the batch state commits each sequence's accepted
        ones) and their outputs [B, n, ...] returned."""
        B, n = tokens.shape
        positions = cache.lengths.unsqueeze(1) + torch.arange(n, device=tokens.device)
        self.forwards += 1
        return self.head(tokens, features, positions, cache, self._mask(causal_tree_mask, B, n, tokens.device))

    def _mask(self, make, B: int, n: int, device) -> torch.Tensor:
        """``make(B, n, device)``, a mask the forwards only read, made once per shape where it is
        small (a round's: n at most 64) and kept."""
        if n > 64:
            return make(B, n, device)
        key = (make, B, n, device)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = make(B, n, device)
        return mask

    def prefill(self, tokens: torch.Tensor, features: torch.Tensor):
        """A sequence's start from its prompt alone: tokens [n] (the prompt's tokens 1..n-1 and its
        first new token) with the target's features [n, H]. Returns its own draft cache (those n
        positions committed, room for a round's drafting after them) and its root step rows [1, 1,
        ...]; (None, None) when nothing is drafted."""
        if not self.drafts:
            return None, None
        n = tokens.numel()
        one = self.new_cache(1, n)
        # In chunks, as the target runs a prompt (LlamaModel.prefill_chunk): a long prompt's
        # attention is then the chunk's tree after a prefix, not one n x n tree.
        for start in range(0, n, PREFILL_CHUNK):
            step = self.catch_up(one, tokens[start: start + PREFILL_CHUNK].unsqueeze(0),
                                 features[start: start + PREFILL_CHUNK].unsqueeze(0))
            one.commit(min(PREFILL_CHUNK, n - start))
        return one, step.rows(torch.full((1, 1), (n - 1) % PREFILL_CHUNK, device=tokens.device))

    # ------------------------------------------------------------------ the tree
    def draft(self, roots: torch.Tensor, cache: Optional[KVCache], root_step: Optional[DraftStep]) -> VerifyTree:
        """This round's trees, rooted at ``roots`` [B] (each sequence's last emitted token), drafted
        after the committed prefixes of ``cache`` (the tree's keys and values written beyond them,
        uncommitted) from ``root_step`` [B, 1, ...]."""
        if not self.drafts:
            return self._roots_alone(roots)
        self._errors = torch.zeros(len(DRAFT_ERRORS), dtype=torch.bool, device=roots.device)
        self._lm_head = self.head.products().lm_head
        if self.tree.choices is not None:
            verify = self._draft_static(DraftTree(roots), cache, root_step)
        else:
            verify = self._draft_dynamic(roots, cache, root_step)
        if verify.tokens.shape[1] > 1:
            self._errors[1] |= (verify.counts < 2).any()
        verify.errors = self._errors
        return verify

    def _roots_alone(self, roots: torch.Tensor) -> VerifyTree:
        """Plain decoding's tree, each sequence's root alone: on the CPU from its fixed parts
        (:meth:`_fixed_tree`), two tensor calls instead of seven."""
        if roots.device.type != "cpu":
            return DraftTree(roots).every_node()
        kept = self._fixed_tree(roots.shape[0], 0, 0)
        return VerifyTree(roots.reshape(-1, 1).to(torch.int64), kept.parents, kept.depths, kept.mask, kept.counts,
                          kept.errors)

    def _fixed_tree(self, B: int, children: int, extra: int) -> VerifyTree:
        """The tree of B roots, each with ``children`` children and ``extra`` children of its first
        (the tokens zeros, no errors), as growing a :class:`DraftTree` makes it, kept per shape: a
        tree whose shape is the same every round needs only its new tokens. On the CPU, where each
        of a decoding step's small host ops costs several times its warm time (the step's weights
        stream leaves the host's working set cold)."""
        key = (B, children, extra)
        kept = self._fixed_trees.get(key)
        if kept is None:
            zeros = lambda *size: torch.zeros(size, dtype=torch.int64)  # noqa: E731
            grown = DraftTree(zeros(B))
            if children:
                layer = grown.add_children(zeros(B, 1), zeros(B, 1, children), zeros(B, 1, children).float())
                if extra:
                    grown.add_children(layer[:, :1], zeros(B, 1, extra), zeros(B, 1, extra).float())
            kept = self._fixed_trees[key] = grown.every_node()
            kept.errors = torch.zeros(len(DRAFT_ERRORS), dtype=torch.bool)
        return kept

    def _topk(self, features: torch.Tensor, k: int):
        """Top-k (log-probabilities, target token ids) of features [B, R, (E,) H] under the draft's LM
        head (as :meth:`DraftHead.products` holds it)."""
        lp, ids = ops.contrastive_topk(features, None, None, self._lm_head, k)
        bad = ids < 0  # the op's mark of a row whose logits are not finite
        self._errors[0] |= bad.any()
        return lp, self.head.target_ids(ids.masked_fill(bad, 0))

    def _children(self, step: DraftStep, kind: str, hybrid: bool = False):
        """Candidate children of each row of ``step`` for a layer of ``kind`` (SERIAL or EXPERTS):
        (logprobs, ids) [B, R, C], and with ``hybrid`` (the next layer is CONTRASTIVE) also the
        contrastive branch's candidates two tokens ahead [B, R, k]. All the features of one call
        share a single pass over the LM head."""
        k = self.width
        if kind == EXPERTS:
            lp, ids = self._topk(step.branch_features(), k)  # [B, R, 2, k]
            return dedupe(lp.flatten(2), ids.flatten(2)), None
        if hybrid:
            lp, ids = self._topk(torch.stack([step.feature, step.contrastive_feature()], 2), k)  # [B, R, 2, k]
            return (lp[:, :, 0], ids[:, :, 0]), (lp[:, :, 1], ids[:, :, 1])
        return self._topk(step.for_lm_head, k), None

    def _run_layer(self, cache: KVCache, tree: DraftTree, frontier: torch.Tensor, depth: int, features: torch.Tensor,
                   tree_kv: TreeKV, kv_nodes: Optional[torch.Tensor], keep_kv: bool = True) -> DraftStep:
        """One draft forward over the frontier nodes [B, R] (all at ``depth``) with the features
        [B, R, H] their parents' step predicted, attending to the committed prefix, their
        ancestors among earlier layers' nodes ``kv_nodes`` [B, M] (keys in ``tree_kv``), and
        themselves; their keys and values kept in ``tree_kv`` for a later layer (``keep_kv``;
        the last layer run has none)."""
        B, R = frontier.shape
        positions = (cache.lengths.unsqueeze(1) - 1 + depth).expand(B, R)
        if kv_nodes is not None:
            tree_kv.visible = tree.ancestors_among(frontier, kv_nodes)
        itself = self._mask(diagonal_mask, B, R, frontier.device)
        step = self.head(tree.tokens.gather(1, frontier), features, positions, cache, itself, tree_kv)
        if keep_kv:
            tree_kv.append(cache, R)
        self.forwards += 1
        return step

    def _draft_dynamic(self, roots: torch.Tensor, cache: KVCache, root_step: DraftStep) -> VerifyTree:
        k, kinds = self.tree.top_k, self._kinds_drafted()
        # The root's children come from its step; each later layer from a forward (SERIAL, EXPERTS),
        # the last step (the root's where no forward follows) also giving the CONTRASTIVE layer's
        # candidates; then the MLP heads' layers (MLP), all in one pass.
        expansions = sum(kind in FORWARD_KINDS for kind in kinds[1:])
        (lp, ids), contrastive = self._children(root_step, kinds[0], expansions == 0 and CONTRASTIVE in kinds)
        if expansions == 0 and MLP not in kinds:
            whole = self._from_root_step(roots, ids, contrastive)
            if whole is not None:
                return whole
        tree = DraftTree(roots)
        layer = tree.add_children(torch.zeros_like(tree.tokens), ids, lp)
        self._attach_contrastive(tree, layer, contrastive)
        prev_step, prev_rows = root_step, torch.zeros_like(layer)  # the step row holding each parent's output
        tree_kv, kv_nodes = TreeKV(), None
        for d in range(1, expansions + 1):
            pick = tree.frontier(layer, k)
            frontier = layer.gather(1, pick)
            features = take_rows(prev_step.feature, prev_rows.gather(1, pick))
            step = self._run_layer(cache, tree, frontier, d, features, tree_kv, kv_nodes, keep_kv=d < expansions)
            kv_nodes = frontier if kv_nodes is None else torch.cat([kv_nodes, frontier], 1)
            hybrid = d == expansions and CONTRASTIVE in kinds
            (lp, ids), contrastive = self._children(step, kinds[d], hybrid)
            C = ids.shape[-1]
            layer = tree.add_children(frontier, ids, lp)
            prev_step, prev_rows = step, torch.arange(frontier.shape[1], device=layer.device).repeat_interleave(C).expand_as(layer)
            self._attach_contrastive(tree, layer, contrastive)
        if MLP in kinds:
            self._draft_parallel(tree, layer, prev_step, prev_rows)
        return tree.kept(self.tree.total_tokens)

    def _kinds_drafted(self) -> tuple:
        """The layers of the schedule a dynamic tree drafts: all, but where the round keeps one
        drafted node (a total of 2) the root's children alone. That node is a child of the root:
        a deeper node never outscores its ancestors (log-probabilities <= 0, ties to the lower
        index), so a later layer's forward would be drafted for nothing."""
        return self.schedule[:1] if self.tree.total_tokens <= 2 else self.schedule

    def _from_root_step(self, roots: torch.Tensor, ids: torch.Tensor, contrastive) -> Optional[VerifyTree]:
        """The tree of the root's step alone (no draft forward after it: Jakiro's depth-1 trees)
        where it is kept whole (at most the round's total nodes): the root, its children ``ids``
        [B, 1, C] in rank order and (``contrastive``) their best's (the first: the candidates come
        best first) children. On the CPU its parents, depths and mask are its shape's
        (:meth:`_fixed_tree`; the test compares them with the grown tree's), only the tokens new: a
        few tensor calls where growing and keeping the tree took seventy (0.3 ms of a round). None
        where the tree is larger than the total, or off the CPU (the general path)."""
        B, _, C = ids.shape
        extra = 0 if contrastive is None else contrastive[1].shape[-1]
        if 1 + C + extra > self.tree.total_tokens or ids.device.type != "cpu":
            return None
        shape = self._fixed_tree(B, C, extra)
        tokens = [roots.reshape(B, 1).to(torch.int64), ids[:, 0]] + ([] if contrastive is None else [contrastive[1][:, 0]])
        return VerifyTree(torch.cat(tokens, 1), shape.parents, shape.depths, shape.mask, shape.counts)

    @staticmethod
    def _attach_contrastive(tree: DraftTree, layer: torch.Tensor, contrastive) -> None:
        """The contrastive branch's candidates (logprobs, ids) [B, R, C] of the R frontier nodes
        whose children ``layer`` [B, R * C] just got (None: no contrastive layer here). The branch
        at a frontier node predicts two tokens ahead, assuming the draft's best next token: attach
        under the node's best child (not under the r-th selected child, the released code's slip)
        with that child's score."""
        if contrastive is None:
            return
        lp, ids = contrastive
        children = layer.view(layer.shape[0], ids.shape[1], -1)
        best = children.gather(2, tree.scores.gather(1, layer).view_as(children).argmax(2, keepdim=True))
        tree.add_children(best.squeeze(2), ids, lp)

    def _draft_parallel(self, tree: DraftTree, layer: torch.Tensor, step: DraftStep, rows: torch.Tensor) -> None:
        """Gumiho's later layers. The ``top_k`` best nodes of ``layer`` (the last serial layer's
        children; ``rows``: the row of ``step`` holding each one's parent) are the leaves: each
        gets the MLP heads' input ``cat(x_parent, x_leaf)``, the ``fc`` outputs of its parent (as
        the parent's serial step ran it) and of itself, and one pass of the heads gives every later
        layer's feature. Layer j: each frontier node takes the ``top_k`` best tokens of head j at
        its leaf, the children are scored cumulatively, and the ``top_k`` best are the next
        frontier (the released code pairs the two inputs by frontier rank, not by parentage; here
        a leaf is paired with its own parent, as in training)."""
        k = self.tree.top_k
        pick = tree.frontier(layer, k)
        leaves, parent_rows = layer.gather(1, pick), rows.gather(1, pick)  # [B, R]
        x_parent = take_rows(step.projected, parent_rows)
        x_leaf = self.head.project_input(tree.tokens.gather(1, leaves), take_rows(step.feature, parent_rows))
        features = self.head.mlp_heads(torch.cat([x_parent, x_leaf], -1))  # [B, R, J, H]
        lp, ids = self._topk(features, k)  # [B, R, J, k]: every head's candidates in one LM-head pass
        frontier, leaf_of = leaves, torch.arange(leaves.shape[1], device=leaves.device).expand_as(leaves)
        for j in range(features.shape[2]):
            index = leaf_of.unsqueeze(-1).expand(-1, -1, k)
            children = tree.add_children(frontier, ids[:, :, j].gather(1, index), lp[:, :, j].gather(1, index))
            pick = tree.frontier(children, k)
            frontier, leaf_of = children.gather(1, pick), leaf_of.repeat_interleave(k, 1).gather(1, pick)

    def _draft_static(self, tree: DraftTree, cache: KVCache, root_step: DraftStep) -> VerifyTree:
        """Every path of the static tree, as the same nodes for every sequence: the candidates of
        a node are its draft's distinct tokens in rank order, and path (..., r) takes rank r."""
        B = tree.tokens.shape[0]
        step, tree_kv, kv_nodes = root_step, TreeKV(), None
        plan = self._static_plan(tree.tokens.device)
        for depth, (above, above_rows, parents, rows, ranks) in enumerate(plan, 1):
            if above is not None:  # run the layer above (the parents) to get their outputs
                frontier = above.expand(B, -1)
                step = self._run_layer(cache, tree, frontier, depth - 1, take_rows(step.feature, above_rows.expand(B, -1)),
                                       tree_kv, kv_nodes, keep_kv=depth < len(plan))
                kv_nodes = frontier if kv_nodes is None else torch.cat([kv_nodes, frontier], 1)
            (lp, ids), _ = self._children(step, self.schedule[depth - 1])  # [B, R, C] for the step's rows
            tree.add_children(parents.expand(B, -1), ids[:, rows, ranks].unsqueeze(-1), lp[:, rows, ranks].unsqueeze(-1))
        return tree.every_node()

    def _static_plan(self, device) -> list:
        """The static tree as index tensors, worked out once on the host: per depth, the nodes of
        the layer above to run first (None at depth 1: the root's step is at hand) with their
        parents' rows in the step before, then each new node's parent, its parent's row in the
        step and its child rank."""
        if self._plan is None:
            paths = sorted({tuple(p) for p in self.tree.choices}, key=lambda p: (len(p), p))
            node_of, parent_of, row_of = {(): 0}, {0: -1}, {0: 0}  # row_of: a node's row in the step run over it
            as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
            plan = []
            for depth in range(1, max(map(len, paths)) + 1):
                layer = [p for p in paths if len(p) == depth]
                above = above_rows = None
                if depth > 1:
                    nodes = sorted({node_of[p[:-1]] for p in layer})
                    above, above_rows = as_tensor([nodes]), as_tensor([[row_of[parent_of[n]] for n in nodes]])
                    row_of = {n: r for r, n in enumerate(nodes)}
                parents = [node_of[p[:-1]] for p in layer]
                first = len(node_of)  # the new nodes' indices follow the tree's current ones
                for i, (p, parent) in enumerate(zip(layer, parents)):
                    node_of[p], parent_of[first + i] = first + i, parent
                plan.append((above, above_rows, as_tensor([parents]), as_tensor([row_of[n] for n in parents]),
                             as_tensor([p[-1] for p in layer])))
            self._plan = plan
        return self._plan


def _width(tree) -> int:
    """A tree's children per node: top_k, or a static tree's widest child rank + 1."""
    return tree.top_k if tree.choices is None else max(int(p[-1]) for p in tree.choices) + 1
