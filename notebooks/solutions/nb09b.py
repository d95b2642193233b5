"""Solutions to the exercises of notebook 09b (the radix prefix cache)."""

from stagewise.exercises.radix_checks import Node


def my_match(root: Node, token_ids: list[int]) -> int:
    limit = len(token_ids) - 1  # the last token is always computed: its logits are needed
    node, pos = root, 0
    while pos < limit:
        child = node.children.get(token_ids[pos])
        if child is None:
            break
        k = 0
        while k < len(child.tokens) and pos + k < limit and child.tokens[k] == token_ids[pos + k]:
            k += 1
        pos += k
        if k < len(child.tokens):
            break  # the match ends inside this run: token granularity, wherever the block edge is
        node = child
    return pos


def my_insert(root: Node, token_ids: list[int]) -> int:
    node, pos = root, 0
    while pos < len(token_ids):
        child = node.children.get(token_ids[pos])
        if child is None:  # nothing here starts with this token: the rest is a new leaf
            node.children[token_ids[pos]] = Node(tuple(token_ids[pos:]), parent=node)
            return len(token_ids) - pos
        k = 0
        while k < len(child.tokens) and pos + k < len(token_ids) and child.tokens[k] == token_ids[pos + k]:
            k += 1
        if k < len(child.tokens) and pos + k < len(token_ids):  # they part inside the run: split it
            top = Node(child.tokens[:k], parent=node, lock=child.lock, last_use=child.last_use)
            node.children[top.tokens[0]] = top
            child.tokens, child.parent = child.tokens[k:], top
            top.children[child.tokens[0]] = child
            child = top
        node, pos = child, pos + k
    return 0  # the whole sequence was a path already (it may end inside a run)


def my_evict(root: Node, count: int) -> list[tuple]:
    def leaves(node):
        for child in node.children.values():
            if child.children:
                yield from leaves(child)
            elif not child.lock:
                yield child

    removed = []
    candidates = list(leaves(root))
    while candidates and len(removed) < count:
        leaf = min(candidates, key=lambda n: n.last_use)  # the least recently used
        candidates.remove(leaf)
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        removed.append(leaf.tokens)
        if parent is not root and not parent.children and not parent.lock:
            candidates.append(parent)  # its last child went: a leaf now
    return removed


SOLUTIONS = {
    "09b.radix_match": my_match,
    "09b.radix_insert": my_insert,
    "09b.radix_evict": my_evict,
}
