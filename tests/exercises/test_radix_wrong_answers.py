"""The wrong answers students write for notebook 09b's radix tree: each must FAIL its check.

Each is the solution (notebooks/solutions/nb09b.py) with one rule broken: a match that stops at
block boundaries (as the hashed cache does), or that takes the last token too; an insert that
splits a run one token late, or that files the new sequence beside the run instead of splitting
it; an eviction that removes an in-use (locked) node, that takes the most recent leaf first, or
that never frees a parent whose last child went.
"""

from collections import Counter

import pytest

from stagewise.exercises import result
from stagewise.exercises.radix_checks import (
    BLOCK_SIZE,
    EVICT_RULES,
    INSERT_RULES,
    MATCH_RULES,
    Node,
    insert_cases,
    match_cases,
    nodes_of,
    walk,
)
from tests.exercises.test_notebook_exercises import solutions

NB = solutions("09b_radix_cache")


def match_at_block_edges(root, token_ids):
    found = NB["09b.radix_match"](root, token_ids)
    return found - found % BLOCK_SIZE  # whole blocks only: the hashed cache's answer


def match_with_the_last_token(root, token_ids):
    node, pos = root, 0
    while pos < len(token_ids):  # no limit: the last token's logits would never be computed
        child = node.children.get(token_ids[pos])
        if child is None:
            break
        k = 0
        while k < len(child.tokens) and pos + k < len(token_ids) and child.tokens[k] == token_ids[pos + k]:
            k += 1
        pos += k
        if k < len(child.tokens):
            break
        node = child
    return pos


def insert_splitting_late(root, token_ids):
    node, pos = root, 0
    while pos < len(token_ids):
        child = node.children.get(token_ids[pos])
        if child is None:
            node.children[token_ids[pos]] = Node(tuple(token_ids[pos:]), parent=node)
            return len(token_ids) - pos
        k = 0
        while k < len(child.tokens) and pos + k < len(token_ids) and child.tokens[k] == token_ids[pos + k]:
            k += 1
        if k < len(child.tokens) and pos + k < len(token_ids):
            k += 1  # one token too late: the upper half keeps a token the new sequence does not have
            top = Node(child.tokens[:k], parent=node, lock=child.lock, last_use=child.last_use)
            node.children[top.tokens[0]] = top
            child.tokens, child.parent = child.tokens[k:], top
            top.children[child.tokens[0]] = child
            child = top
        node, pos = child, pos + k
    return 0


def insert_beside_without_splitting(root, token_ids):
    node, pos = root, 0
    while pos < len(token_ids):
        child = node.children.get(token_ids[pos])
        if child is None or tuple(token_ids[pos : pos + len(child.tokens)]) != child.tokens:
            found = walk(root, token_ids)[0]  # the count it reports is right; the tree is not
            if child is not None and tuple(token_ids[pos:]) == child.tokens[: len(token_ids) - pos]:
                return 0  # inside the run already
            node.children[token_ids[pos]] = Node(tuple(token_ids[pos:]), parent=node)  # the old run is lost
            return len(token_ids) - found
        node, pos = child, pos + len(child.tokens)
    return 0


def evict_locked_too(root, count):
    return _evict(root, count, key=lambda n: n.last_use, skip_locked=False)


def evict_most_recent_first(root, count):
    return _evict(root, count, key=lambda n: -n.last_use)


def evict_leaves_only(root, count):
    return _evict(root, count, key=lambda n: n.last_use, parents=False)


def _evict(root, count, key, skip_locked=True, parents=True):
    candidates = [n for _, n in nodes_of(root) if not n.children and (not n.lock or not skip_locked)]
    removed = []
    while candidates and len(removed) < count:
        leaf = min(candidates, key=key)
        candidates.remove(leaf)
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        removed.append(leaf.tokens)
        if parents and parent is not root and not parent.children and (not parent.lock or not skip_locked):
            candidates.append(parent)
    return removed


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("09b.radix_match", match_at_block_edges),
        ("09b.radix_match", match_with_the_last_token),
        ("09b.radix_insert", insert_splitting_late),
        ("09b.radix_insert", insert_beside_without_splitting),
        ("09b.radix_evict", evict_locked_too),
        ("09b.radix_evict", evict_most_recent_first),
        ("09b.radix_evict", evict_leaves_only),
    ],
)
def test_a_wrong_answer_fails(name, fn):
    outcome = result(name, fn)
    assert outcome.status == "fail", outcome.line()


def test_stubs_are_not_yet():
    def stub(*args):
        raise NotImplementedError

    for name in NB:
        assert result(name, stub).status == "not yet"


def test_every_rule_decides_something():
    assert set(Counter(rule for *_, rule in match_cases())) == set(MATCH_RULES)
    assert set(Counter(rule for *_, rule in insert_cases())) == set(INSERT_RULES)
    line = result("09b.radix_evict", NB["09b.radix_evict"]).message
    assert all(f"{label} 0" not in line for label in EVICT_RULES.values()), line
