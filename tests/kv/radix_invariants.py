"""What must hold of a radix prefix cache after every operation (used by the property tests).

`contents`: the fake KV cache of the property tests, slot -> the token prefix whose K/V it holds
(what real K/V depend on), or None to skip the content check (before a step's writes).
"""

from stagewise.kv.block_manager import BlockManager
from stagewise.kv.radix_cache import RadixCache


def path_tokens(node) -> tuple:
    runs = []
    while node.parent is not None:
        runs.append(node.tokens)
        node = node.parent
    return tuple(t for run in reversed(runs) for t in run)


def check_tree(bm: BlockManager, running_ids, contents: dict | None = None) -> None:
    cache: RadixCache = bm.prefixes
    bs = bm.block_size
    listed = [0] * bm.num_blocks
    reachable = set()
    for node in cache.nodes():
        reachable.add(id(node))
        assert node.tokens, "a node with an empty run"
        assert node.parent.children.get(node.tokens[0]) is node, "a child filed under the wrong token"
        assert node.start == node.parent.end, "a run does not start where its parent ends"
        assert len(node.blocks) == (node.end - 1) // bs - node.start // bs + 1, "blocks do not cover the run"
        assert node.lock >= 0
        for b in node.blocks:
            listed[b] += 1
        if contents is not None:  # every listed block holds its path's K/V up to the node's end
            tokens, first = path_tokens(node), node.start // bs
            for i, b in enumerate(node.blocks):
                for p in range((first + i) * bs, min((first + i + 1) * bs, node.end)):
                    assert contents.get(b * bs + p % bs) == tokens[: p + 1], f"block {b} lost position {p}"
    holders = list(listed)
    for row in bm.req_blocks.values():
        for b in row:
            holders[b] += 1
    assert [blk.ref_count for blk in bm.blocks] == holders, "reference counts disagree with nodes + requests"
    assert sorted(bm.free_queue) == [b for b in range(bm.num_blocks) if holders[b] == 0], "free queue is wrong"
    # locks: a node's count is the number of running requests whose held path passes through it
    expected = {}
    for rid, node in cache.locked.items():
        assert rid in running_ids, f"{rid} left but still locks a path"
        assert id(node) in reachable, f"the node {rid} holds was removed (an in-use node evicted)"
        while node is not cache.root:
            expected[id(node)] = expected.get(id(node), 0) + 1
            node = node.parent
    for node in cache.nodes():
        assert node.lock == expected.get(id(node), 0), "a lock count disagrees with the requests' paths"
