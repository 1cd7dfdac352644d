"""Tests for report.py: the page a tiny training run writes, read back with the standard library's
HTML parser, as a browser would read it.

One tiny run (conftest's tiny model, a scripted judge so that every group has explanations and
advantages) is shared by the module; tests that change its files work on a copy.
"""
import html
import json
import re
import shutil
from html.parser import HTMLParser

import pytest

import agentrl
import grpo
import report
import train
from test_train import ScriptedJudge, tiny_args

VOID = {"meta", "img", "br", "hr", "link", "input"}


class Node:
    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children = tag, dict(attrs), []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find_all(self, predicate):
        for child in self.children:
            if isinstance(child, Node):
                if predicate(child):
                    yield child
                yield from child.find_all(predicate)


class TreeBuilder(HTMLParser):
    """Builds the element tree and fails on anything not well-formed: a closing tag that does not
    close the innermost open element, or an element left open at the end."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", [])
        self.stack = [self.root]
        self.tags = []

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs)
        self.stack[-1].children.append(node)
        self.tags.append(tag)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Node(tag, attrs))
        self.tags.append(tag)

    def handle_endtag(self, tag):
        assert tag not in VOID and self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse(path):
    return parse_html(path.read_text(encoding="utf-8"))


def parse_html(text):
    builder = TreeBuilder()
    builder.feed(text)
    builder.close()
    assert builder.stack == [builder.root], f"left open: {[n.tag for n in builder.stack[1:]]}"
    return builder


def has_class(name):
    return lambda node: name in node.attrs.get("class", "").split()


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """A 2-step run of 2 groups x 3 trajectories, judged by a script that spreads the scores."""
    out = tmp_path_factory.mktemp("run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "make_judge", lambda args, model, tokenizer, device: ScriptedJudge())
        train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--eval-split", "test"))
    return out


def trajectory_records(run_dir):
    return {int(p.stem[5:]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted((run_dir / "trajectories").glob("step_*.jsonl"))}


def test_the_run_writes_a_well_formed_page_with_every_trajectory(tiny_run):
    """train.py writes report.html; it parses as well-formed HTML, holds every trajectory of every
    step under its own anchor, loads nothing from outside (no script, the plot inline), and shows
    the config, the held-out accuracy of each phase, paired start to end, and the judge's explanations."""
    page = parse(tiny_run / "report.html")
    expected = [f"s{step:04d}-g{g + 1}-t{k}" for step, rs in trajectory_records(tiny_run).items()
                for g in sorted({r["group"] for r in rs}) for k in range(1, sum(r["group"] == g for r in rs) + 1)]
    found = [n.attrs["id"] for n in page.root.find_all(has_class("trajectory"))]
    assert found == expected and len(found) == 12
    assert "script" not in page.tags and "link" not in page.tags
    [plot] = page.root.find_all(lambda n: n.tag == "img")
    assert plot.attrs["src"].startswith("data:image/png;base64,")
    rows = [[cell.text() for cell in tr.find_all(lambda n: n.tag == "td")] for tr in page.root.find_all(lambda n: n.tag == "tr")]
    assert ["group_size", "3"] in rows and ["seed", "3"] in rows, "the config"
    assert [row[:2] for row in rows if row[:2] in (["start", "test"], ["step 2", "test"])] == [["start", "test"], ["step 2", "test"]]
    assert re.search(r"RL start → end, paired by question .*test: 0\.\d{3} -> 0\.\d{3} on 2 tasks: .* McNemar p=",
                     page.root.text(), re.S), "the start and the end, paired"
    assert page.root.text().count("scripted") == 12, "each trajectory shows the judge's explanation"


def test_each_trajectory_shows_the_advantage_the_update_used(tiny_run):
    """The trajectories file records each trajectory's advantage, a turn each, equal to GRPO's group
    advantage of the rewards beside it, and the page shows it (once, every turn's being the same)
    next to the reward, correctness and judge score."""
    page = parse(tiny_run / "report.html")
    by_id = {n.attrs["id"]: n.text() for n in page.root.find_all(has_class("trajectory"))}
    for step, rs in trajectory_records(tiny_run).items():
        for g in sorted({r["group"] for r in rs}):
            group = [r for r in rs if r["group"] == g]
            advantages = grpo.normalized([r["reward"] for r in group])
            for k, (r, a) in enumerate(zip(group, advantages), 1):
                assert r["advantage"] == pytest.approx([a] * len(r["advantage"])) and r["advantage"]   # a turn each
                shown = by_id[f"s{step:04d}-g{g + 1}-t{k}"]
                assert f"reward {r['reward']:.3f}" in shown and f"advantage {a:.3f}" in shown
                assert f"judge {r['judge_score']:.2f}" in shown and ("correct" if r["correct"] else "wrong") in shown


def test_the_shared_prefix_is_shown_once_per_group(tiny_run):
    """The messages every trajectory of a group shares (system prompt, worked example, question)
    are printed once per group, as the judge's prompt prints them, not once per trajectory."""
    page = parse(tiny_run / "report.html")
    groups = list(page.root.find_all(lambda n: n.tag == "section" and has_class("group")(n)))
    assert len(groups) == 4
    for group in groups:
        systems = list(group.find_all(lambda n: has_class("msg")(n) and has_class("system")(n)))
        [prefix] = group.find_all(has_class("prefix"))
        assert len(systems) == 1 and systems[0] in list(prefix.find_all(lambda n: True))


def test_each_group_is_drawn_as_its_tree_of_turns_with_mean_rewards():
    """render_tree: past the shared messages, each turn once with the trajectories through it and
    their mean reward, the turns taken after it nested below it."""
    prefix = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    listing = [{"role": "assistant", "content": "list"}, {"role": "tool", "content": "t"}]
    conversations = [prefix + listing + [{"role": "assistant", "content": "run <1>"}],
                     prefix + listing + [{"role": "assistant", "content": "run 2"}],
                     prefix + [{"role": "assistant", "content": "other"}]]
    records = [{"reward": 1.0}, {"reward": 0.0}, {"reward": 0.5}]
    tree = parse_html(report.render_tree(records, conversations, prefix=2))
    top = next(tree.root.find_all(lambda n: n.tag == "ul"))          # the outermost
    items = [n for n in top.children if isinstance(n, Node)]
    assert [" ".join(n.text().split()) for n in items] == [
        "list · 2 trajectories, mean reward 0.500"
        "run <1> · 1 trajectory, mean reward 1.000run 2 · 1 trajectory, mean reward 0.000",
        "other · 1 trajectory, mean reward 0.500"]
    assert "mean reward 0.500)" in tree.root.text()


def test_untrusted_text_shows_as_text(tiny_run, tmp_path):
    """A trajectory whose model output, SQL, observation and judge explanation hold HTML (a
    <script>, a closing tag) is shown as that text: the rebuilt page has no script element and
    stays well-formed."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    path = run / "trajectories" / "step_0001.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    evil = '<script>alert("x")</script></div>'
    call = '<tool_call>{"name": "run_sql", "arguments": {"query": "SELECT \'%s\'"}}</tool_call>' % evil.replace('"', '\\"')
    records[0]["messages"] += [{"role": "assistant", "content": call}, {"role": "tool", "content": "Error: " + evil},
                               {"role": "assistant", "content": "I think " + evil + "\n" + agentrl.tool_call_text("list_tables", {})}]
    records[0]["judge_explanation"] = evil
    records[0]["submitted_sql"] = evil
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    report.main([str(run)])
    page = parse(run / "report.html")
    assert "script" not in page.tags
    [first] = page.root.find_all(lambda n: n.attrs.get("id") == "s0001-g1-t1")
    assert first.text().count(evil) == 5    # the call's SQL, the observation, the text around a call, judge, submitted
    assert html.escape(evil) in (run / "report.html").read_text()


def test_a_line_cut_short_is_skipped_and_counted(tiny_run, tmp_path):
    """A trajectories line cut short by a kill mid-write cannot stop the report (train.py rewrites
    it every step): that line is skipped, the page says how many were, the rest are there."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    with open(run / "trajectories" / "step_0002.jsonl", "a") as f:
        f.write('{"step": 2, "group": 1, "task_id": "retail-tr')
    report.write_report(run)
    page = parse(run / "report.html")
    assert len(list(page.root.find_all(has_class("trajectory")))) == 12
    assert "1 unreadable lines skipped" in page.root.text()


def test_report_of_a_folder_that_is_not_a_run_is_a_clear_error(tmp_path):
    """`python report.py` on a folder without metrics.jsonl says so, and writes nothing."""
    with pytest.raises(SystemExit, match="not a run folder"):
        report.main([str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_sql_highlighting_keeps_the_text():
    """The highlighter only wraps keywords, strings and numbers in spans: with the tags taken out
    and the entities read back, the text is the query, character for character."""
    sql = "SELECT name, COUNT(*) FROM t WHERE x < 3 AND s = 'it''s <b>' -- done\n  ORDER BY 2 DESC"
    marked = report.highlight_sql(sql)
    assert html.unescape(re.sub(r"<[^>]+>", "", marked)) == sql
    assert '<span class="kw">SELECT</span>' in marked and '<span class="string">&#x27;it&#x27;&#x27;s &lt;b&gt;&#x27;</span>' in marked
    assert '<span class="number">3</span>' in marked and "<b>" not in marked
