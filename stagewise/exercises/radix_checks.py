"""Checks for notebook 09b's radix tree: match, insert and evict, against the package's RadixCache.

The student works on a plain tree of `Node`s (a run of token ids per edge, children keyed by
their first token, a lock count, a last-use time) — the shape of the package's tree without its
KV blocks. Each check builds a real radix prefix cache (`BlockManager(prefix_cache="radix")`),
copies its tree into `Node`s with `tree_of`, calls the student's function on the copy and the
package on the original, and compares. The workloads are built so that each rule decides
something, and each check prints how often it did:

    match    hits that end inside a block (a block-granular match stops short), inside a run
             (two sequences part there), a whole stored sequence (the last token is never
             matched), misses
    insert   a new leaf beside others, a run split where the new sequence parts from it, a
             sequence that runs on past a leaf, one already in the tree
    evict    locked paths older than every unlocked leaf (an eviction that takes an in-use
             node removes them first), parents that become leaves as their last child goes

Trees are compared as sets of paths and branch points (`shape`): the package may keep a run cut
in two where a textbook tree has one node (it cuts where a running request's held path ends),
and that is not a difference a student can see.
"""

import random
from collections import Counter
from dataclasses import dataclass, field

from stagewise.exercises.core import Mismatch, call, equal
from stagewise.kv.block_manager import BlockManager

BLOCK_SIZE = 4


@dataclass(eq=False)
class Node:
    """One node of the exercise's radix tree (the root has an empty run and no parent)."""

    tokens: tuple = ()  # the run of token ids on the edge from the parent into this node
    parent: "Node | None" = None
    children: dict = field(default_factory=dict)  # first token of a child's run -> the child
    lock: int = 0  # running requests whose path passes here: never evicted while > 0
    last_use: int = 0  # when the node was last used: smaller = longer ago (no two nodes share one)

    def __repr__(self) -> str:
        return f"Node({list(self.tokens)}, {len(self.children)} children, lock {self.lock}, used {self.last_use})"


def tree_of(cache) -> Node:
    """A `Node` copy of a RadixCache's tree; last_use ranks the package's (clock, creation) order."""
    nodes = cache.nodes()
    rank = {id(n): i + 1 for i, n in enumerate(sorted(nodes, key=lambda n: (n.last_use, n.serial)))}
    root, copies, todo = Node(), {}, [(cache.root, None)]
    while todo:
        node, parent = todo.pop()
        copy = root if parent is None else Node(tuple(node.tokens), parent, {}, node.lock, rank[id(node)])
        if parent is not None:
            parent.children[copy.tokens[0]] = copy
        copies[id(node)] = copy
        todo.extend((child, copy) for child in node.children.values())
    return root


def shape(root: Node) -> list[tuple]:
    """The tree as a sorted list of (path to the node, its run), after merging every non-root node
    that has exactly one child and no lock of its own into that child (a canonical radix tree)."""
    out, todo = [], [((), child) for child in root.children.values()]
    while todo:
        path, node = todo.pop()
        run = tuple(node.tokens)
        while len(node.children) == 1:
            (node,) = node.children.values()
            run += tuple(node.tokens)
        out.append((path, run))
        todo.extend((path + run, child) for child in node.children.values())
    return sorted(out)


def check_tree(root, what: str) -> None:
    """The tree is well formed: runs non-empty, children filed under their first token, parents."""
    if not isinstance(root, Node):
        raise Mismatch(f"{what}: expected the root Node, got {type(root).__name__}")
    todo = [root]
    while todo:
        node = todo.pop()
        for first, child in node.children.items():
            if not child.tokens or child.tokens[0] != first:
                raise Mismatch(f"{what}: a child filed under token {first} holds the run {list(child.tokens)}")
            if child.parent is not node:
                raise Mismatch(f"{what}: the node {list(child.tokens)} does not point back to its parent")
            todo.append(child)


# ---- workloads: a real radix cache, fed as the engine feeds it ----


def families(seed: int) -> list[list[int]]:
    """Sequences sharing prefixes of every length, parting inside blocks and on their edges."""
    rng = random.Random(seed)
    base = [rng.randrange(1, 9) for _ in range(30)]
    out = [base[:n] + [rng.randrange(9, 20) for _ in range(rng.randrange(1, 9))] for n in (0, 6, 9, 13, 16, 22)]
    out.append(base[:27])
    out.append(out[2][:-1] + [30])  # parts from a stored sequence at its very last token
    return out


def stored(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """A request computed `tokens` and finished: the cache keeps all of them."""
    bm.begin_step()
    hit = bm.match_prefix(tokens + [0])
    assert bm.allocate(rid, 0, len(tokens) - hit.num_tokens, cached_prefix=hit)
    bm.free(rid, tokens, len(tokens))


def running(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """A request that computed `tokens` and still runs: it locks its path (whole blocks)."""
    bm.begin_step()
    hit = bm.match_prefix(tokens + [0])
    assert bm.allocate(rid, 0, len(tokens) - hit.num_tokens, cached_prefix=hit)
    bm.register_full_blocks(rid, tokens, len(tokens))


# ---- match ----

MATCH_RULES = {"in_block": "ending inside a block", "edge": "ending on a block edge", "whole": "whole sequences"}
MATCH_RULES |= {"miss": "misses"}


def match_cases(seed: int = 5):
    """Yield (tree copy, query, tokens the package matches, rule)."""
    bm = BlockManager(96, BLOCK_SIZE, prefix_cache="radix")
    seqs = families(seed)[:5]
    for i, s in enumerate(seqs):
        stored(bm, f"s{i}", s)
    rng = random.Random(seed)
    queries = [s + [rng.randrange(20, 30)] for s in seqs]  # a stored sequence, then one token more
    queries += [s[:n] + [99] for s in seqs for n in (3, 5, 7, 8, 10) if n < len(s)]  # parting early
    queries += [list(s) for s in seqs]  # exactly a stored sequence: its last token is never matched
    queries += [[99, 1, 2], [5]]
    bm.begin_step()  # a new step: everything stored is written
    for q in queries:
        want = bm.match_prefix(q).num_tokens
        rule = "miss" if not want else "whole" if q in seqs else "in_block" if want % BLOCK_SIZE else "edge"
        yield tree_of(bm.prefixes), q, want, rule


def check_match(fn) -> str:
    """my_match(root, token_ids) -> how many leading tokens the tree holds (never the last one)."""
    counts = Counter()
    for i, (root, query, want, rule) in enumerate(match_cases()):
        got = call(fn, root, list(query))
        equal(got, want, f"match {i}: {query}")
        counts[rule] += 1
    return f"{sum(counts.values())} lookups agree with RadixCache.match: {tally(counts, MATCH_RULES)}"


def tally(counts: Counter, names: dict) -> str:
    return ", ".join(f"{label} {counts[k]}" for k, label in names.items())


def walk(root: Node, seq) -> tuple[int, bool]:
    """(tokens of `seq` found along the tree, whether the walk stopped inside a run)."""
    node, pos = root, 0
    while pos < len(seq):
        child = node.children.get(seq[pos])
        if child is None:
            return pos, False
        k = 0
        while k < len(child.tokens) and pos + k < len(seq) and child.tokens[k] == seq[pos + k]:
            k += 1
        pos += k
        if k < len(child.tokens):
            return pos, True
        node = child
    return pos, False


# ---- insert ----

INSERT_RULES = {"leaf": "new branches", "split": "runs split", "past": "past a leaf", "present": "already there"}


def insert_cases(seed: int = 7):
    """Yield (the tree before, the sequence inserted, the package's tree after, rule)."""
    bm = BlockManager(128, BLOCK_SIZE, prefix_cache="radix")
    seqs = families(seed)
    for i, s in enumerate([*seqs, seqs[3], seqs[1] + [40, 41, 42], seqs[2][:5]]):
        before = tree_of(bm.prefixes)
        found, inside = walk(before, s)
        rule = "present" if found == len(s) else "split" if inside else "past" if found else "leaf"
        stored(bm, f"i{i}", s)
        yield before, s, tree_of(bm.prefixes), rule


def check_insert(fn) -> str:
    """my_insert(root, token_ids) -> how many tokens it added (those not on a path already); the
    tree holds token_ids as a path from the root afterwards."""
    counts = Counter()
    for i, (root, seq, after, rule) in enumerate(insert_cases()):
        added = len(seq) - walk(root, seq)[0]
        got = call(fn, root, list(seq))
        equal(got, added, f"insert {i} of {seq}: tokens added")
        check_tree(root, f"insert {i}")
        equal(shape(root), shape(after), f"insert {i} of {seq}: the tree's paths")
        counts[rule] += 1
    return f"{sum(counts.values())} inserts agree with RadixCache.insert: {tally(counts, INSERT_RULES)}"


# ---- evict ----

EVICT_RULES = {"locked": "beside older locked paths", "parent": "freeing parents in turn"}


def history(seed: int) -> BlockManager:
    """A cache whose oldest path is locked (a request still running), then finished ones: some
    part from the locked trunk, two from a branch of their own that no request holds."""
    bm = BlockManager(128, BLOCK_SIZE, prefix_cache="radix")
    seqs = families(seed)
    running(bm, "busy", seqs[5])
    branch = [50 + (seed + i) % 7 for i in range(6)]
    for i, s in enumerate([seqs[0], branch + [60, 61], seqs[1], branch + [70, 71, 72], *seqs[2:5]]):
        stored(bm, f"s{i}", s)
    running(bm, "late", seqs[6])
    return bm


def evict_cases(seed: int = 9):
    """Yield (tree copy, nodes to evict, the runs the package removes, the tree it leaves)."""
    for k in range(4):
        for count in (1, 3, 6, 12):
            root, bm = tree_of(history(seed + k).prefixes), history(seed + k)
            removed = bm.prefixes.evict_nodes(count)
            yield root, count, [list(r) for r in removed], tree_of(bm.prefixes)


def check_evict(fn) -> str:
    """my_evict(root, count) -> the runs of the `count` nodes removed, in the order removed."""
    counts = Counter()
    for i, (root, count, want, after) in enumerate(evict_cases()):
        leaves = sum(1 for _, n in nodes_of(root) if not n.children and not n.lock)
        got = call(fn, root, count)
        equal([list(r) for r in got], want, f"eviction {i} ({count} nodes): the runs removed, in order")
        check_tree(root, f"eviction {i}")
        equal(shape(root), shape(after), f"eviction {i}: the tree left")
        counts["locked"] += 1
        counts["parent"] += len(want) > leaves
    return f"{counts['locked']} evictions agree with RadixCache.evict: {tally(counts, EVICT_RULES)}"


def nodes_of(root: Node):
    """(depth, node) of every node but the root."""
    todo = [(1, child) for child in root.children.values()]
    while todo:
        depth, node = todo.pop()
        yield depth, node
        todo.extend((depth + 1, child) for child in node.children.values())


CHECKS = {
    "09b.radix_match": check_match,
    "09b.radix_insert": check_insert,
    "09b.radix_evict": check_evict,
}
