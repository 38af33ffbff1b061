"""The visualisation: DOT that parses to one node per circuit node and one edge per value, a
Chrome trace whose slices and counters agree with the report, a self-contained HTML page (checked
as text and in a real headless Chromium), the layout's invariants, and `circuit viz`."""
import html
import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from urllib.parse import quote

import pytest
import torch

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.cli import main
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.circuit.report import PlanReport
from draft_circuit.circuit.viz import render_html, to_dot, trace_events, write_all
from draft_circuit.circuit.viz.graph import GROUPS, bands, op_group, tint
from draft_circuit.circuit.viz.layout import place_dag
from draft_circuit.circuit.viz.routes import route_dag


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> PlanReport:
    """The real MTP chain, through the CLI and the report JSON, as a user gets it."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", "--widths", "1,2,4,8", "--num-drafts", "4", "--json", str(path)]) == 0
    return PlanReport.from_json(path.read_text())


def tiny_compiled(widths=(1, 4)):
    """Nodes before, inside and after two steps, and an edge from before the steps to after."""
    b = CircuitBuilder("tiny", max_width=4)
    x, w = b.input("x", "float32", ("n", 8)), b.param("w", "float32", (8, 8))
    pre = h = b.op1("linear", [x, w], name="pre")
    for s in range(2):
        with b.scope(f"s{s}"):
            # the product first: fuse_linear_add folds only add(x, linear), so these stay two nodes
            h = b.op1("add", [b.op1("linear", [h, w], name="proj"), h], name="res")
    b.output(b.op1("add", [h, pre], name="post"), "y")
    params = {"w": torch.empty(8, 8, device="meta")}
    return compile_draft(b.build(), params, list(widths), device="cpu")


# ---- DOT: a parser for the subset to_dot writes; anything else in the text fails it
TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>->|[{}\[\];,=])|(?P<id>[\w.#-]+))')


def tokens(text: str) -> list[str]:
    out, pos = [], 0
    while text[pos:].strip():
        m = TOKEN.match(text, pos)
        assert m and m.end() > pos, f"DOT does not tokenise at {text[pos:pos + 40]!r}"
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


def unquote(tok: str) -> str:
    return re.sub(r"\\(.)", r"\1", tok[1:-1]) if tok.startswith('"') else tok


def parse_dot(text: str) -> tuple[dict, list, dict]:
    """(node -> (attrs, enclosing clusters), [(src, dst, attrs)], cluster -> label)."""
    toks, nodes, edges, clusters = tokens(text), {}, [], {}
    assert toks[:3][0] == "digraph" and toks[2] == "{", toks[:3]
    i = 3

    def attrs() -> dict:
        nonlocal i
        out = {}
        if i < len(toks) and toks[i] == "[":
            i += 1
            while toks[i] != "]":
                assert toks[i + 1] == "=", toks[i:i + 3]
                out[toks[i]] = unquote(toks[i + 2])
                i += 3 + (toks[i + 3] == ",")
            i += 1
        return out

    def block(path: tuple) -> None:
        nonlocal i
        while toks[i] != "}":
            if toks[i] == "subgraph":
                name, i = unquote(toks[i + 1]), i + 3
                assert toks[i - 1] == "{"
                clusters[name] = ""
                block((*path, name))
            elif toks[i] in ("graph", "node", "edge"):
                i += 1
                attrs()
            elif toks[i + 1] == "=":
                clusters[path[-1]] = unquote(toks[i + 2]) if toks[i] == "label" else clusters[path[-1]]
                i += 3
            elif toks[i + 1] == "->":
                src, dst = unquote(toks[i]), unquote(toks[i + 2])
                i += 3
                edges.append((src, dst, attrs()))
            else:
                name = unquote(toks[i])
                i += 1
                assert name not in nodes, f"node {name} declared twice"
                nodes[name] = (attrs(), path)
            if toks[i] == ";":
                i += 1
        i += 1

    block(())
    assert i == len(toks), f"text after the graph: {toks[i:i + 5]}"
    return nodes, edges, clusters


def test_dot_has_one_node_per_circuit_node_and_one_edge_per_value(report):
    nodes, edges, clusters = parse_dot(to_dot(report))
    assert set(nodes) == {n.name for n in report.nodes}
    producer = {v: n.name for n in report.nodes for v in n.outputs}
    want = {(producer[v], n.name, v): n.shapes[v] for n in report.nodes for v in n.inputs if v in producer}
    assert len(edges) == len(want)
    assert {(s, d, a["tooltip"]): a["label"] for s, d, a in edges} == want  # labelled by spec
    for n in report.nodes:
        attrs, path = nodes[n.name]
        if n.step is not None:
            assert path[0] == f"cluster_s{n.step}", (n.name, path)
        if n.fused:  # alone in its own dashed cluster, its parts in its label
            assert path[-1].startswith("cluster_fused_") and "fused" in clusters[path[-1]]
            assert sum(1 for _, p in nodes.values() if p[-1:] == path[-1:]) == 1
            assert all(part in attrs["label"] for part in n.fused)
    assert sum(1 for c in clusters if c.startswith("cluster_fused_")) == sum(1 for n in report.nodes if n.fused)


def test_dot_quotes_names_that_need_it():
    text = to_dot(tiny_compiled().report())
    parsed, _, _ = parse_dot(text)
    assert {"pre", "s0.proj", "s1.res", "post"} <= set(parsed)
    assert '"s0.proj" ->' in text or '-> "s0.proj"' in text


# ---- the Chrome trace
def test_trace_slices_and_counters_agree_with_the_report(report):
    data = json.loads(json.dumps(trace_events(report)))  # what a viewer loads
    events = data["traceEvents"]
    for w in report.widths:
        mine = [e for e in events if e["pid"] == w.width]
        names = [e["args"]["name"] for e in mine if e["ph"] == "M" and e["name"] == "process_name"]
        assert names == [f"width {w.width}"]
        slices = [e for e in mine if e["ph"] == "X"]
        assert len(slices) == w.launches
        assert [e["name"] for e in slices] == [x.node for x in w.schedule]
        t = 0.0
        for e, x in zip(slices, w.schedule):
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["ts"] == pytest.approx(t, abs=1e-5) and e["dur"] >= 0
            assert e["args"]["kernel"] == x.kernel and e["args"]["bytes_read"] == x.bytes_read
            t = e["ts"] + e["dur"]
        assert t == pytest.approx(w.floor_us, abs=1e-3)  # back to back: the floor time
        counters = [e for e in mine if e["ph"] == "C"]
        assert len(counters) == w.launches + 1 and counters[-1]["args"]["bytes"] == 0
        assert max(c["args"]["bytes"] for c in counters) == w.lower_bound_bytes
        assert [c["ts"] for c in counters[:-1]] == [e["ts"] for e in slices]


# ---- the HTML, as text
def test_html_names_every_node_and_fetches_nothing(report):
    page = render_html(report)
    for n in report.nodes:
        assert f'data-node="{html.escape(n.name, quote=True)}"' in page, n.name
        assert f"<title>{html.escape(n.name)}</title>" in page, n.name
    for ref in ("http://", "https://", "<script src", "<link", "@import", "<img", "<iframe"):
        assert ref not in page.lower(), ref
    assert not re.search(r"url\((?!#)", page), "only in-page url(#...) references"
    embedded = re.search(r'<script type="application/json" id="plan-report">(.*?)</script>', page, re.S)
    assert PlanReport.model_validate(json.loads(embedded.group(1))) == report
    rows = re.findall(r'<tr data-width="(\d+)"', page)
    assert rows == [str(w.width) for w in report.widths]
    assert page.count('<option value="') == len(report.widths)


def test_layout_keeps_boxes_apart_inside_their_bands(report):
    for plan in (report, tiny_compiled().report()):
        layout = place_dag(plan)
        route_dag(layout)
        boxes = list(layout.boxes.values())
        frames = {f.key: f for f in layout.frames}
        for i, a in enumerate(boxes):
            f = frames[a.band]
            assert f.x <= a.x and a.x + a.w <= f.x + f.w and f.y <= a.y and a.bottom <= f.y + f.h
            for b in boxes[i + 1:]:
                apart = a.x + a.w <= b.x or b.x + b.w <= a.x or a.bottom <= b.y or b.bottom <= a.y
                assert apart, (a.node.name, b.node.name)
        producer = {v: n.name for n in plan.nodes for v in n.outputs}
        pairs = {(producer[v], n.name) for n in plan.nodes for v in n.inputs if v in producer}
        assert sorted((r.src, r.dst) for r in layout.routes) == sorted(pairs)
        assert all(r.d.startswith("M") for r in layout.routes)
    assert [b.key for b in bands(tiny_compiled().report())] == ["before", "s0", "s1", "after"]


def test_write_all_takes_a_compiled_draft(tmp_path):
    compiled = tiny_compiled()
    paths = write_all(compiled, tmp_path / "out")
    assert [p.name for p in paths] == ["plan.html", "circuit.dot", "schedule.json"]
    assert 'data-node="s1.res"' in paths[0].read_text()


def test_cli_viz_writes_the_three_files(tmp_path, capsys):
    out = tmp_path / "viz"
    assert main(["viz", "--widths", "1,2", "--num-drafts", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == ["circuit.dot", "plan.html", "schedule.json"]
    assert json.loads((out / "schedule.json").read_text())["traceEvents"]
    assert "digraph" in (out / "circuit.dot").read_text()
    # the MTP input: embedding, both norms, concat and eh_proj are one launch
    assert 'data-node="s1.embedding+s1.enorm+s1.hnorm+s1.concat+s1.eh_proj"' in (out / "plan.html").read_text()


# ---- the HTML, in a real browser
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0", "--hide-scrollbars"]


def chromium(page: Path, profile: Path, *extra: str, fragment: str = "") -> subprocess.CompletedProcess:
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); .ci/run installs it")
    cmd = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri() + fragment]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def console_lines(stderr: str, page: Path) -> list[str]:
    """The page's console messages: chromium logs them as `CONSOLE(line)] "text", source: URL`."""
    return [m.group(1) for m in re.finditer(r'CONSOLE[^\]]*\] "(.*)", source: (\S+)', stderr)
            if m.group(2).split("#")[0] == page.as_uri()]


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit non-interlaced PNG: just enough zlib."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, []
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + size]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and not interlace
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + size
    bpp, raw = (3 if ctype == 2 else 4), zlib.decompress(b"".join(idat))
    stride, prev, rows = w * bpp, bytearray(w * bpp), []
    for y in range(h):  # undo each row's filter (PNG spec, 9.2)
        f, cur = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 2:  # "up", the commonest: one vectorised pass
            cur = bytearray(map(lambda u, b: (u + b) & 255, cur, prev))
        elif f:
            for x in range(stride):
                a = cur[x - bpp] if x >= bpp else 0
                b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
                if f == 4:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                else:
                    pred = a if f == 1 else (a + b) >> 1
                cur[x] = (cur[x] + pred) & 255
        rows.append(bytes(cur))
        prev = cur
    return w, h, rows


def test_page_renders_in_headless_chromium_without_console_errors(report, tmp_path):
    page, png = write_all(report, tmp_path / "viz")[0], tmp_path / "plan.png"
    run = chromium(page, tmp_path / "profile", "--dump-dom", f"--screenshot={png}",
                   "--window-size=1400,1000")
    assert run.returncode == 0 and png.exists(), run.stderr[-2000:]
    assert 'data-rendered="1"' in run.stdout and "data-error" not in run.stdout
    width = max(w.width for w in report.widths)  # the page opens on the largest width
    assert run.stdout.count('class="buf"') == len(report.width(width).buffers)
    assert re.search(rf'<tr data-width="{width}" tabindex="0" class="selected">', run.stdout)
    # its one console line, and nothing else: no uncaught error, no console.error or warning
    assert console_lines(run.stderr, page) == [
        f"viz: rendered {len(report.nodes)} nodes, {len(report.widths)} widths"]

    w, h, rows = png_pixels(png.read_bytes())
    assert (w, h) == (1400, 1000)
    bpp = len(rows[0]) // w
    pixels = {row[i:i + 3] for row in rows for i in range(0, len(row), bpp)}
    assert len(pixels) > 300, "the screenshot is (nearly) blank"
    # node fills: the DAG is on screen, every op group the plan has (after fusion there may be no
    # plain norm node left: the default plan folds each rmsnorm into the linear it feeds)
    groups = {op_group(n.op) for n in report.nodes}
    assert {"matmul", "attention"} <= groups, groups
    for group in sorted(groups):
        fill = bytes.fromhex(tint(GROUPS[group][1], 0.8)[1:])
        assert fill in pixels, group


def test_page_address_opens_a_width_with_a_node_pinned(report, tmp_path):
    page = write_all(report, tmp_path / "viz")[0]
    fused = next(n for n in report.nodes if n.fused and n.step == 1)  # a name with '+' and dots
    width = min(w.width for w in report.widths)
    dom = chromium(page, tmp_path / "profile", "--dump-dom",
                   fragment=f"#width={width}&node={quote(fused.name, safe='')}")
    assert dom.returncode == 0 and 'data-rendered="1"' in dom.stdout, dom.stderr[-2000:]
    assert re.search(rf'<tr data-width="{width}" tabindex="0" class="selected">', dom.stdout)
    details = dom.stdout.split('id="detail-body"')[1].split("</aside>")[0]
    assert f"<h3>{html.escape(fused.name)}</h3>" in details and "pinned" in details
    assert len(fused.origin) == len(fused.fused) > 1
    for part, o in zip(fused.fused, fused.origin):  # each part and the layer line that built it
        assert (f'<li><code>{html.escape(part)}</code> built at <code class="origin" title="'
                f'builder scope {o.scope}">{html.escape(o.file)}:{o.line}</code></li>') in details
    launch = next(x for x in report.width(width).schedule if x.node == fused.name)
    assert f"{launch.kernel} (width {width})" in details
    assert re.search(rf'class="node [^"]*hot[^"]*" data-node="{re.escape(html.escape(fused.name))}"', dom.stdout)
