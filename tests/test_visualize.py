"""Graph pictures: the view model, graphviz SVG/PNG/DOT, and the HTML page in a real headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import moecompile as mc
from moecompile import Role
from moecompile.errors import MoecompileError
from moecompile.models import build_model
from moecompile.visualize import ROLE_COLORS, build_view, visualize
from moecompile.history import PassRecord
from moecompile.visualize.model import OP_COLORS, color_of, overlap_notes

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("MOECOMPILE_ARTIFACTS", Path(__file__).resolve().parents[1] / "out" / "test-artifacts"))
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed (apt-get install graphviz)")


@pytest.fixture(scope="module")
def result():
    model, (ids,) = build_model("tiny-llama")
    return mc.convert(model, {"experts": {"num_experts": 4, "top_k": 2, "aux_loss": "aux"}}, (ids,))


@pytest.fixture(scope="module")
def graph(result) -> fx.Graph:
    return result.record("upcycle").graph


def _in_module(graph: fx.Graph, path: str) -> set[str]:
    view = build_view(graph)
    inside = {g.id for g in view.groups if g.path == path or g.path.startswith(path + ".")}
    return {n.name for n in view.nodes if n.group in inside}


def test_every_role_has_its_own_colour():
    assert set(ROLE_COLORS) == {r.value for r in Role}
    assert len(set(ROLE_COLORS.values())) == len(ROLE_COLORS)
    assert not set(ROLE_COLORS.values()) & set(OP_COLORS.values())


def test_view_groups_nodes_by_module_and_colours_by_role(graph):
    view = build_view(graph, "t")
    assert len(view.nodes) == len(graph.nodes)
    groups = {g.path: g for g in view.groups}
    assert groups["model.layers.0.mlp"].label == "mlp · MoE (4 experts, top-2)"
    assert groups["model.layers.0.self_attn"].label == "self_attn · LlamaAttention"
    assert groups["model.layers.0"].layer and not groups["model.layers.0.mlp"].layer
    by_name = {n.name: n for n in view.nodes}
    # parameters sit with their module (or their first user), not at the top of the graph
    assert view.groups[by_name["model_layers_0_mlp_experts_w_gate_up"].group].path == "model.layers.0.mlp"
    assert view.groups[by_name["model_layers_0_self_attn_q_proj_weight"].group].path == "model.layers.0.self_attn.q_proj"
    for node in graph.nodes:
        role = node.meta.get("moe", {}).get("role")
        assert by_name[node.name].color == (ROLE_COLORS[role.value] if role else OP_COLORS[node.op])
    experts = [n for n in view.nodes if n.role == "experts"]
    assert len(experts) == 4 and all(n.label == "grouped_mm" for n in experts)
    assert by_name["grouped_mm"].values == ["[32, 128] float32"] and by_name["grouped_mm"].detail == "32x128 f32"
    assert by_name["grouped_mm"].moe == {"layer": "model.layers.0.mlp", "role": "experts"}
    assert by_name["grouped_mm"].stack.startswith("modeling_llama.py:")


def test_raw_collectives_are_coloured_as_start_and_wait():
    g = fx.Graph()
    x = g.placeholder("x")
    a2a = g.call_function(torch.ops._c10d_functional.all_to_all_single.default, (x, [4, 4], [4, 4], "ep"))
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (a2a,))
    g.output(wait)
    by_name = {n.name: n for n in build_view(g).nodes}
    assert by_name[a2a.name].color == ROLE_COLORS["collective_start"]
    assert by_name[wait.name].color == ROLE_COLORS["collective_wait"]
    assert color_of(None, "placeholder") == OP_COLORS["placeholder"]


def _overlapped_record() -> PassRecord:
    """x -> all_to_all -> wait, with relu(x) recorded as running while the exchange is in flight."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    a2a = g.call_function(torch.ops._c10d_functional.all_to_all_single.default, (x, [2, 2], [2, 2], "ep"))
    busy = g.call_function(torch.ops.aten.relu.default, (x,))
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (a2a,))
    g.output((wait, busy))
    data = {"schedule": {"l0": {"collectives": [{"start": a2a.name, "wait": wait.name, "nodes": [busy.name]}]}}}
    return PassRecord("overlap", True, 0.0, "", 5, 0, {}, ["l0: dispatch overlaps relu"], data, g)


def test_overlap_records_link_collectives_to_the_work_they_hide(tmp_path):
    rec = _overlapped_record()
    view = build_view(rec.graph, notes=overlap_notes(rec.data))
    by_name = {n.name: n for n in view.nodes}
    relu = by_name["relu_default"].id
    assert by_name["all_to_all_single_default"].notes == {"overlaps": [relu]}
    assert by_name["wait_tensor_default"].notes == {"overlaps": [relu]}
    assert by_name["relu_default"].notes == {"overlapped by": [by_name["all_to_all_single_default"].id]}
    text = visualize(rec, tmp_path / "o.html").read_text()
    assert '"notes":{"overlaps":[' in text and "l0: dispatch overlaps relu" in text


def test_layer_selects_one_block_and_its_boundary(graph):
    full = build_view(graph)
    view = build_view(graph, layer=1)
    inside = _in_module(graph, "model.layers.1")
    names = {n.name for n in view.nodes}
    assert inside <= names and len(names) < len(full.nodes)
    external = {n.name for n in view.nodes if n.external}
    assert external and not external & inside and external | inside == names
    assert {n.name for n in build_view(graph, layer="model.layers.1").nodes} == names
    for n in view.nodes:  # edges stay inside the selection
        assert all(0 <= i < len(view.nodes) for i in n.inputs + n.users)
    with pytest.raises(MoecompileError, match="2 repeating layers"):
        build_view(graph, layer=2)
    with pytest.raises(MoecompileError, match="names no module"):
        build_view(graph, layer="model.layers.9")


def test_visualize_picks_the_pass_and_marks_what_it_added(result, tmp_path):
    path = mc.visualize(result, tmp_path / "g.html", after="upcycle")  # the package is callable
    data = json.loads(re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', path.read_text(), re.S).group(1))
    new = {n["name"] for n in data["nodes"] if n["new"]}
    assert "grouped_mm" in new and "route" in new and "embedding" not in new
    before = {n.name for n in result.record("find_ffn").graph.nodes}
    assert new == {n.name for n in result.record("upcycle").graph.nodes} - before
    with pytest.raises(MoecompileError, match="no such pass"):
        visualize(result, tmp_path / "x.html", after="nope")
    with pytest.raises(MoecompileError, match="format"):
        visualize(result, tmp_path / "x.jpeg")


def test_html_is_self_contained(result, tmp_path):
    text = result.visualize(tmp_path / "g.html", after="upcycle").read_text()
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    urls = set(re.findall(r"https?://[^\s\"')]+", text))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls


def _svg_nodes(path: Path) -> dict[str, str]:
    """SVG node id (node-<fx name>) -> its fill colour."""
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    out = {}
    for g in root.iter(f"{ns}g"):
        if g.get("class") == "node":
            shape = next(e for e in g.iter() if e.tag in (f"{ns}path", f"{ns}polygon", f"{ns}ellipse"))
            out[g.get("id")] = shape.get("fill")
    return out


@needs_dot
def test_svg_has_every_node_in_its_role_colour(result, graph, tmp_path):
    nodes = _svg_nodes(visualize(result, tmp_path / "g.svg", after="upcycle"))
    assert len(nodes) == len(graph.nodes)
    for node in graph.nodes:
        role = node.meta.get("moe", {}).get("role")
        assert nodes[f"node-{node.name}"] == (ROLE_COLORS[role.value] if role else OP_COLORS[node.op]), node.name
    assert sum(fill == ROLE_COLORS["experts"] for fill in nodes.values()) == 4
    root = ET.parse(tmp_path / "g.svg").getroot()
    clusters = {g.get("id"): "".join(g.itertext()) for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "cluster"}
    assert "MoE (4 experts, top-2)" in clusters["cluster-model.layers.0.mlp"]
    assert len(clusters) == len(build_view(graph).groups) - 1  # every module group but the root


@needs_dot
def test_svg_collapsed_group_is_one_box(result, graph, tmp_path):
    path = visualize(result, tmp_path / "c.svg", collapse=["model.layers.1"])
    nodes = _svg_nodes(path)
    assert len(nodes) == len(graph.nodes) - len(_in_module(graph, "model.layers.1")) + 1
    assert "group-model.layers.1" in nodes
    with pytest.raises(MoecompileError, match="names no module group"):
        visualize(result, tmp_path / "c.svg", collapse=["model.layers.7"])


@needs_dot
def test_png_and_dot(result, tmp_path):
    png = visualize(result, tmp_path / "g.png", layer=0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dot = visualize(result, tmp_path / "g.dot").read_text()
    assert dot.startswith("digraph") and "subgraph cluster_" in dot and ROLE_COLORS["router"] in dot


# ---- the HTML page in a real browser ---------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, result, tmp_path):
    path = visualize(result, tmp_path / "graph.html", after="upcycle")
    pg = browser.new_page(viewport={"width": 1400, "height": 900})
    pg.set_default_timeout(5000)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(path.as_uri())
    pg.wait_for_selector("body[data-ready='1']", timeout=15000)
    yield pg
    pg.close()
    assert not errors, errors


def _click_node(page, name: str) -> None:
    """Pan the node into view (as a user would), then click it."""
    node = page.locator(f"#viewport .node[data-name='{name}']")
    page.evaluate("id => moeGraph.centerOn('n' + id)", node.get_attribute("data-id"))
    node.click()


def test_html_renders_every_node(page, graph):
    assert page.locator("#viewport .node").count() == len(graph.nodes)
    assert page.locator("#visible-count").inner_text() == f"{len(graph.nodes)} of {len(graph.nodes)} nodes shown"
    fills = page.eval_on_selector_all("#viewport .node[data-role='experts'] rect", "els => els.map(e => e.getAttribute('fill'))")
    assert fills == [ROLE_COLORS["experts"]] * 4
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "graph_after_upcycle.png"
    _click_node(page, "grouped_mm")  # the MoE block in view, its first expert GEMM's metadata in the panel
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


def test_html_collapsing_a_group_hides_its_nodes(page, graph):
    attn = _in_module(graph, "model.layers.0.self_attn")
    assert "scaled_dot_product_attention" in attn
    sdpa = page.locator("#viewport .node[data-name='scaled_dot_product_attention']")
    assert sdpa.is_visible()
    group = page.locator("#viewport .group[data-path='model.layers.0.self_attn']")
    page.evaluate("id => moeGraph.centerOn('g' + id)", group.get_attribute("data-id"))  # pan it into view
    group.locator("> .group-toggle").click()
    assert page.locator("#viewport .node").count() == len(graph.nodes) - len(attn)
    assert sdpa.count() == 0
    box = page.locator("#viewport .cgroup[data-path='model.layers.0.self_attn']")
    assert box.is_visible() and f"({len(attn)} nodes)" in box.text_content()
    page.evaluate("id => moeGraph.centerOn('c' + id)", box.get_attribute("data-id"))
    box.click()
    assert page.locator("#viewport .node").count() == len(graph.nodes) and sdpa.is_visible()


def test_html_clicking_a_node_shows_its_metadata(page):
    _click_node(page, "grouped_mm")
    assert page.inner_text("#panel-name") == "grouped_mm"
    assert page.inner_text("#panel-target") == "moecompile.grouped_mm.default"
    assert page.inner_text("#panel-role") == "experts"
    assert page.inner_text("#panel-values") == "[32, 128] float32"
    assert json.loads(page.inner_text("#panel-moe")) == {"layer": "model.layers.0.mlp", "role": "experts"}
    assert page.locator("#viewport .node.selected").get_attribute("data-name") == "grouped_mm"
    page.click("#panel a[data-node]:text('glu')")  # follow a user link
    assert page.inner_text("#panel-name") == "glu"


def test_html_search_and_layer_selector(page, graph):
    page.fill("#search", "role:experts")
    assert page.inner_text("#search-count") == "4 matches"
    assert page.locator("#viewport .node.match").count() == 4
    page.press("#search", "Enter")
    assert page.inner_text("#panel-name") == "grouped_mm"
    page.select_option("#layer", label="model.layers.1")
    want = {n.name for n in build_view(graph, layer="model.layers.1").nodes}
    shown = set(page.eval_on_selector_all("#viewport .node", "els => els.map(e => e.dataset.name)"))
    assert shown == want


def test_html_panel_lists_what_a_collective_overlaps(browser, tmp_path):
    path = visualize(_overlapped_record(), tmp_path / "o.html")
    pg = browser.new_page(viewport={"width": 1200, "height": 800})
    pg.set_default_timeout(5000)
    pg.goto(path.as_uri())
    pg.wait_for_selector("body[data-ready='1']")
    assert pg.locator("#viewport .node").count() == 5
    pg.click("#viewport .node[data-name='all_to_all_single_default']")
    assert pg.inner_text("#panel-role") == "collective_start"
    assert pg.inner_text(".panel-note[data-note='overlaps']") == "relu_default"
    assert pg.locator("#viewport .node.neighbor[data-name='relu_default']").count() == 1
    pg.close()
