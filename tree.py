"""A group's tree: what its trajectories share, one structure for the rollout, the judge and the update.

    root = build_tree(paths)     # paths[i]: trajectory i as its runs, [(start, tokens, messages), ...]
    root.children[0].through     # the trajectories through the first run (the prompt: all of them)

The n trajectories of a group answer one task: they share the prompt, and often their first turns
and the tool's answers. A Node is a run of tokens (and the messages they render) that every
trajectory in `through` has, from index `start` on; a trajectory is the path from the root to its
last node. agentrl.make_group builds a rollout's tree from the turns the engine recorded (a node a
turn); judge.py prints it once for the judge; forward.py forwards each node once in the update.
It imports nothing, so the judge stays usable alone.
"""
from dataclasses import dataclass, field


@dataclass
class Node:
    """A run of a group's tree: tokens (and the messages they render) that the trajectories in `through`
    all have, from index `start` of their token_ids on, after the runs of the node's ancestors."""
    start: int                      # the index of its first token in each trajectory through it
    tokens: list[int]
    messages: list[dict]
    through: list[int]              # the group's trajectories through it, by index
    children: list["Node"] = field(default_factory=list)


def build_tree(paths) -> Node:
    """The tree of trajectories given as runs: paths[i] = [(start, tokens, messages), ...] in order.
    Two trajectories share a node exactly when they share its run and every run before it. The
    root is empty and holds every trajectory.

        trajectory 0: [prompt][list_tables + answer][run_sql A + answer][submit A]
        trajectory 1: [prompt][list_tables + answer][run_sql B + answer]
        tree:  root -> prompt {0, 1} -> list_tables {0, 1} -> run_sql A {0} -> submit A {0}
                                                           -> run_sql B {1}
    """
    root = Node(0, [], [], list(range(len(paths))))
    for i, runs in enumerate(paths):
        node = root
        for start, tokens, messages in runs:
            child = next((c for c in node.children if c.tokens == tokens and c.messages == messages), None)
            if child is None:
                child = Node(start, tokens, messages, [])
                node.children.append(child)
            child.through.append(i)
            node = child
    return root
