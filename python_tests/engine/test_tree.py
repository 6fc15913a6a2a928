"""The draft tree as a value: its mask grown with it (a child's row its parent's with its own bit)
is the ancestor mask of its parents, through keeping, re-indexing and padding; one builder."""
import pytest
import torch

from conftest import gen, random_parents
from jakiro_ext import ops
from jakiro_ext.engine.tree import DraftTree, VerifyTree


def dense_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T]: node j is node i or an ancestor of it, walking up the parents one by one."""
    B, T = parents.shape
    seen = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            j = i
            while j >= 0:
                seen[b, i, j] = True
                j = int(parents[b, j])
    return seen


@pytest.mark.parametrize("batch,nodes,max_children", [(1, 1, 0), (2, 5, 0), (3, 64, 0), (2, 65, 3), (2, 200, 2),
                                                      (1, 129, 1)])
def test_build_tree_mask_is_the_ancestor_relation(batch, nodes, max_children):
    parents = random_parents(batch, nodes, seed=nodes, max_children=max_children)
    assert torch.equal(ops.build_tree_mask(parents), ops.pack_bits(dense_ancestors(parents)))


def grown_tree(batch: int, layers: int, width: int, seed: int) -> DraftTree:
    """A tree grown as the drafter grows one: each layer's best nodes get ``width`` children,
    some candidates repeated (-inf)."""
    g = gen(seed)
    tree = DraftTree(torch.randint(0, 50, (batch,), generator=g))
    layer = torch.zeros(batch, 1, dtype=torch.int64)
    for _ in range(layers):
        frontier = layer.gather(1, tree.frontier(layer, 3))
        lp = -torch.rand(batch, frontier.shape[1], width, generator=g)
        lp[torch.rand(lp.shape, generator=g) < 0.2] = float("-inf")
        layer = tree.add_children(frontier, torch.randint(0, 50, lp.shape, generator=g), lp)
    return tree


@pytest.mark.parametrize("layers,width", [(1, 1), (3, 2), (4, 5), (6, 4)])
def test_the_grown_mask_is_the_parents_ancestor_mask_through_keeping_and_padding(layers, width):
    tree = grown_tree(3, layers, width, seed=layers * 10 + width)
    assert torch.equal(tree.mask, ops.build_tree_mask(tree.parents))  # (more than 64 nodes in the larger ones)
    whole = tree.every_node()
    assert torch.equal(whole.mask, ops.build_tree_mask(whole.parents))
    for total in (2, 5, 17, 70):
        kept = tree.kept(total)
        assert torch.equal(kept.mask, ops.build_tree_mask(kept.parents)), total  # padded nodes: the root and themselves
        assert kept.mask.shape == (3, kept.tokens.shape[1], (kept.tokens.shape[1] + 63) // 64)


def test_ancestors_among_earlier_nodes_are_read_off_the_mask():
    tree = grown_tree(2, 4, 3, seed=5)
    dense = dense_ancestors(tree.parents)
    deepest = (tree.depths == tree.depths.max()).nonzero()
    rows = torch.stack([deepest[deepest[:, 0] == b, 1][:4] for b in range(2)])
    earlier = torch.stack([((tree.depths[b] > 0) & (tree.depths[b] < tree.depths.max())).nonzero()[:9, 0]
                           for b in range(2)])
    visible = tree.ancestors_among(rows, earlier)
    for b in range(2):
        assert torch.equal(visible[b], dense[b][rows[b]][:, earlier[b]])
    assert visible.any() and not visible.all()  # (the test can tell ancestors from the others)


def test_a_tree_within_the_total_is_kept_whole():
    # As many nodes as the total or fewer: every node in place, its count the tree's size, the
    # same nodes as the selection keeps where every candidate is real; a repeated candidate (-inf)
    # stays where the selection would put a padding node (verification accepts neither).
    tree = DraftTree(torch.tensor([4, 4]))
    tree.add_children(torch.zeros(2, 1, dtype=torch.int64), torch.tensor([[[3, 5]], [[3, 3]]]),
                      torch.tensor([[[-0.1, -0.2]], [[-0.1, float("-inf")]]]))
    for total in (3, 4):
        kept = tree.kept(total)
        assert kept.counts.tolist() == [3, 3] and kept.tokens.tolist() == [[4, 3, 5], [4, 3, 3]]
        assert kept.parents.tolist() == [[-1, 0, 0], [-1, 0, 0]] and kept.depths.tolist() == [[0, 1, 1]] * 2
        assert torch.equal(kept.mask, ops.build_tree_mask(kept.parents))
    selected = VerifyTree.select(tree, torch.arange(3).expand(2, 3), torch.tensor([3, 3]))
    whole = tree.kept(3)
    for name in ("tokens", "parents", "depths", "mask", "counts"):
        assert torch.equal(getattr(whole, name), getattr(selected, name)), name
    assert tree.kept(2).tokens.shape == (2, 2)  # (more nodes than the total: selected)
