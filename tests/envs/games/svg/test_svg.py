"""SVG reconstruction: icon generation, the checker against hostile SVG, the sandboxed renderer, similarity."""

import copy
import io
import re
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
import resvg_py
from gymnasium.utils.env_checker import check_env as gym_check_env
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.envs.games.episodes import assert_same_episode
from turnrl.envs import check_env
from turnrl.envs.contract import MAX_TEXT_LENGTH, OBS_CHARSET
from turnrl.envs.games.svg.render import (
    MAX_DEPTH,
    MAX_ELEMENTS,
    SvgRenderer,
    check_svg,
    edge_overlap,
    similarity,
)
from turnrl.envs.games.svg.svg_env import SVGEnv, generate_icon

if "turnrl/SVG-v0" not in gym.registry:  # registered by turnrl.envs once the registry lists it
    gym.register(id="turnrl/SVG-v0", entry_point="turnrl.envs.games.svg:SVGEnv")

NS = 'xmlns="http://www.w3.org/2000/svg"'


def svg(body: str, view_box: str = "0 0 256 256") -> str:
    return f'<svg {NS} viewBox="{view_box}">{body}</svg>'


@pytest.fixture(scope="module")
def env():
    return SVGEnv()


def shapes_svg(env: SVGEnv, shapes, view_box: str = "0 0 256 256") -> str:
    return svg("".join(shape.svg for shape in shapes), view_box)


# --------------------------------------------------------------------------- hostile and malformed SVG
BILLION_LAUGHS = (
    '<?xml version="1.0"?><!DOCTYPE svg [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
    '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>'
    f'<svg {NS}><desc>&d;&d;&d;&d;&d;&d;&d;&d;</desc></svg>'
)
HOSTILE = {
    "billion laughs": (BILLION_LAUGHS, "DOCTYPE"),
    "external entity": (f'<!DOCTYPE svg [<!ENTITY x SYSTEM "file:///etc/passwd">]><svg {NS}>&x;</svg>', "DOCTYPE"),
    "script": (svg("<script>alert(1)</script>"), "<script> is not allowed"),
    "event handler": (svg('<rect width="9" height="9" onload="alert(1)"/>'), "event handler"),
    "external image": (svg('<image href="file:///etc/hostname" width="9" height="9"/>'), "<image> is not allowed"),
    "remote fill": (svg('<rect width="9" height="9" fill="url(http://example.com/x.svg#g)"/>'), "url(#id)"),
    "remote style": (svg('<rect width="9" height="9" style="fill:url(\'https://x.test/a#b\')"/>'), "url(#id)"),
    "gradient link": (svg('<linearGradient id="g" href="http://x.test/g.svg#a"/>'), "only references to ids"),
    "use expansion": (svg('<g id="a"><rect width="1" height="1"/></g><use href="#a"/>'), "<use> is not allowed"),
    "foreign object": (svg("<foreignObject><p>hi</p></foreignObject>"), "<foreignObject> is not allowed"),
    "text": (svg("<text>hi</text>"), "<text> is not allowed"),
    "filter": (svg('<filter id="f"><feGaussianBlur stdDeviation="999"/></filter>'), "<filter> is not allowed"),
    "deep nesting": (svg("<g>" * 5000 + "</g>" * 5000), "the answer has"),
    "nesting": (svg("<g>" * (MAX_DEPTH + 1) + "</g>" * (MAX_DEPTH + 1)), "nested more than"),
    "many elements": (svg('<rect width="1" height="1"/>' * (MAX_ELEMENTS + 1)), f"more than {MAX_ELEMENTS}"),
    "giant path": (svg('<path d="M0 0' + " L1 1" * 5000 + '"/>'), "characters; the limit"),
    "processing instruction": (svg('<?xml-stylesheet href="http://x.test/s.css"?>'), "processing instructions"),
    "not well-formed": ("<svg><rect></svg>", "not well-formed"),
    "other root": ("<svgx></svg>", "not well-formed"),
    "no svg": ("I cannot draw this.", "no <svg>"),
    "foreign namespace": ('<svg xmlns="http://www.w3.org/1999/xhtml"></svg>', "not <svg>"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_svg_is_refused_with_a_message(name):
    text, message = HOSTILE[name]
    check = check_svg(text)
    assert check.svg is None and message in str(check.error), check.error


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_svg_scores_zero_and_says_why(name, env):
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(HOSTILE[name][0])
    assert reward == 0.0 and not terminated and info["action_is_valid"] and not info["action_is_effective"]
    assert info["svg_error"] and "scored 0" in obs["text"]
    assert set(obs["text"]) <= OBS_CHARSET and len(obs["text"]) <= MAX_TEXT_LENGTH
    assert (obs["image"] == 255).all()  # a blank canvas, as VAGEN shows for an answer it cannot render


def test_extreme_coordinates_that_panic_resvg_score_zero_and_the_worker_survives(env):
    env.reset(seed=0)
    hostile = svg('<path d="M0 0 L 1e30 1e30" stroke="black" stroke-width="1e20"/>')
    _, reward, _, _, info = env.step(hostile)
    assert reward == 0.0 and "PanicException" in info["svg_error"]
    _, reward, *_ = env.step(env.solve()[0])
    assert reward == 1.0


def test_answer_may_carry_prose_and_omit_the_namespace():
    check = check_svg('Here it is: <svg viewBox="0 0 8 8"><circle cx="4" cy="4" r="2"/></svg> Done.')
    assert check.error is None and check.svg is not None
    assert check.svg.startswith(f"<svg {NS}") and check.svg.endswith("</svg>")


def test_internal_references_are_allowed():
    body = ('<defs><linearGradient id="g"><stop offset="0" stop-color="red"/></linearGradient>'
            '<clipPath id="c"><rect width="9" height="9"/></clipPath></defs>'
            '<rect width="9" height="9" fill="url(#g)" clip-path="url( \'#c\' )"/>')
    assert check_svg(svg(body)).error is None


def test_editor_attributes_are_ignored_but_their_elements_are_not_allowed():
    inkscape = 'xmlns:inkscape="http://www.inkscape.org/namespaces/inkscape"'
    labelled = f'<svg {NS} {inkscape}><g inkscape:label="Layer 1"><rect width="9" height="9"/></g></svg>'
    assert check_svg(labelled).error is None
    foreign = f'<svg {NS} {inkscape}><inkscape:grid/></svg>'
    assert "<grid> is not allowed" in str(check_svg(foreign).error)


@given(st.text(max_size=400))
@settings(max_examples=300, deadline=None)
def test_check_svg_never_raises(text):
    check = check_svg(text)
    assert (check.svg is None) != (check.error is None)


_TOKENS = st.sampled_from(
    ["<svg>", "</svg>", f"<svg {NS}>", "<g>", "</g>", "<rect", "/>", ">", '<circle r="5"/>', "<path d=\"M0 0 L9",
     '"', "'", "=", " fill=", "url(#a)", "url(x)", "&amp;", "&bogus;", "<!--", "-->", "<![CDATA[", "]]>", "<",
     "1e308", "-", "nan", "\x00", "é", " "]
)


@given(st.lists(_TOKENS, max_size=40).map("".join))
@settings(max_examples=150, deadline=None)
def test_env_step_never_raises_on_svg_like_text(text):
    env = SVGEnv()
    env.reset(seed=1)
    obs, reward, *_ = env.step(text)
    assert 0.0 <= reward <= 1.0 and set(obs["text"]) <= OBS_CHARSET


@pytest.mark.parametrize("action", [None, 3, b"<svg/>", ["<svg/>"]])
def test_non_string_actions_are_invalid(action, env):
    obs, _ = env.reset(seed=0)
    new_obs, reward, terminated, _, info = env.step(action)
    assert not info["action_is_valid"] and reward == 0.0 and not terminated and new_obs["text"] == obs["text"]


# --------------------------------------------------------------------------- the sandboxed renderer
def test_the_worker_cannot_read_files(tmp_path):
    """Past the checker, the worker itself still cannot open a file that an SVG names."""
    picture = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(picture)
    hostile = svg(f'<image href="{picture}" width="256" height="256"/>')
    in_process = np.asarray(Image.open(io.BytesIO(resvg_py.svg_to_bytes(svg_string=hostile, width=32, height=32))))
    assert in_process[16, 16, 0] > 200 and in_process[16, 16, 1] < 50  # resvg alone reads the file
    renderer = SvgRenderer(size=32)
    try:
        render = renderer.render(hostile)
    finally:
        renderer.close()
    assert render.image is not None and (render.image == 255).all()  # the worker could not


def test_a_render_that_overruns_its_time_is_killed_and_the_next_one_works():
    renderer = SvgRenderer(size=64, timeout_s=1e-4)
    try:
        render = renderer.render(svg('<circle cx="128" cy="128" r="99"/>'))
        assert render.image is None and "took longer" in str(render.error)
        renderer.timeout_s = 5.0
        render = renderer.render(svg('<circle cx="128" cy="128" r="99"/>'))
        assert render.image is not None and render.image[32, 32].tolist() == [0, 0, 0]
        assert renderer.starts == 2
    finally:
        renderer.close()


GROUP_SIGNALS = """
import os, signal
from turnrl.envs.games.svg.render import SvgRenderer
SQUARE = '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 256 256"><rect width="256" height="256"/></svg>'
renderer = SvgRenderer(size=32)
assert renderer.render(SQUARE).image is not None
for number in (signal.SIGINT, signal.SIGTERM):
    signal.signal(number, signal.SIG_IGN)  # this process, as a run finishing its step, goes on
    os.killpg(os.getpgid(0), number)  # what Ctrl-C in a terminal and a job-wide SIGTERM send
render = renderer.render(SQUARE)
assert render.image is not None and renderer.starts == 1, (render.error, renderer.starts)
renderer.close()
"""


def test_the_worker_outlives_ctrl_c_and_a_sigterm_sent_to_the_runs_process_group():
    """A run stopped by Ctrl-C or a scheduler's SIGTERM finishes its step: its renders must not fail then (a failed
    render scores the agent's SVG as too costly to draw)."""
    result = subprocess.run([sys.executable, "-c", GROUP_SIGNALS], capture_output=True, text=True, timeout=120,
                            start_new_session=True)  # a process group of its own, as a run's
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_worker_that_dies_mid_render_is_replaced():
    """200 nested translucent groups need a canvas-sized layer each: past the memory cap the worker dies."""
    layers = '<g opacity="0.9">' * 200 + '<rect width="256" height="256"/>' + "</g>" * 200
    renderer = SvgRenderer(size=256, memory_mb=64)
    try:
        failed = renderer.render(svg(layers))
        assert failed.image is None and "stopped" in str(failed.error)
        assert renderer.render(svg("")).image is not None and renderer.starts == 2
        worker = renderer._proc
        assert worker is not None
        worker.kill()  # a worker found dead before a request is replaced before it
        worker.wait()
        assert renderer.render(svg("")).image is not None and renderer.starts == 3
    finally:
        renderer.close()


def test_non_square_canvases_are_drawn_top_left_on_white():
    renderer = SvgRenderer(size=64)
    try:
        image = renderer.render(svg('<rect width="512" height="256" fill="#000"/>', "0 0 512 256")).image
    finally:
        renderer.close()
    assert image is not None and image.shape == (64, 64, 3) and (image[:32] == 0).all() and (image[32:] == 255).all()


# --------------------------------------------------------------------------- similarity
def test_similarity_of_identical_images_is_one(env):
    env.reset(seed=3)
    scores = similarity(env.target, env.target)
    assert (scores.pixel, scores.ssim, scores.edges, scores.total) == (1.0, 1.0, 1.0, 1.0)


def test_similarity_falls_with_the_error(env):
    """A closer answer scores higher: exact > 1 px off > 2 px off > 6 px off > blank canvas."""
    env.reset(seed=4)
    shapes = env.icon.shapes
    rewards = []
    for view_box in ("0 0 256 256", "-1 -1 256 256", "-2 -2 256 256", "-6 -6 256 256"):
        env.reset(seed=4)
        rewards.append(env.step(shapes_svg(env, shapes, view_box))[1])
    env.reset(seed=4)
    rewards.append(env.step(svg(""))[1])
    assert rewards[0] == 1.0 and rewards == sorted(rewards, reverse=True) and rewards[-1] < 0.35
    env.reset(seed=4)
    missing = env.step(shapes_svg(env, shapes[:-1]))[1]
    assert rewards[-1] < missing < 1.0


def test_edge_overlap_counts_near_misses():
    a = np.zeros((32, 32), dtype=bool)
    a[10, 5:25] = True
    assert edge_overlap(a, a) == 1.0
    assert edge_overlap(a, np.roll(a, 1, axis=0)) == 1.0  # within every tolerance (1, 2, 4 px)
    assert edge_overlap(a, np.roll(a, 2, axis=0)) == pytest.approx(2 / 3)  # within 2 and 4 px
    assert edge_overlap(a, np.roll(a, 3, axis=0)) == pytest.approx(1 / 3)  # within 4 px only
    assert edge_overlap(a, np.roll(a, 12, axis=0)) == 0.0
    assert edge_overlap(a, np.zeros_like(a)) == 0.0 and edge_overlap(np.zeros_like(a), np.zeros_like(a)) == 1.0


def test_similarity_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="differ in shape"):
        similarity(np.zeros((4, 4, 3), np.uint8), np.zeros((4, 5, 3), np.uint8))


# --------------------------------------------------------------------------- the env
@pytest.mark.parametrize("mode", ["image", "text"])
def test_gymnasium_check_env(mode):
    made = gym.make("turnrl/SVG-v0", mode=mode, image_size=64, render_mode="rgb_array")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check_env(made.unwrapped)


@pytest.mark.parametrize("mode", ["image", "text"])
def test_turnrl_check_env(mode):
    check_env(SVGEnv(mode=mode, image_size=64), seed=7, steps=4)


def test_same_seed_same_icon_and_target():
    first, second = SVGEnv(), SVGEnv()
    for seed in range(10):
        a, b = first.reset(seed=seed)[0], second.reset(seed=seed)[0]
        assert first.icon == second.icon and np.array_equal(a["image"], b["image"])
    icons = {first.reset(seed=seed) and first.icon.svg for seed in range(40)}
    assert len(icons) == 40


def test_same_seed_same_whole_episode_infos_included(env):
    """A rough answer, one that cannot be drawn, then the expert's: the same scores and renders on both plays."""
    answers = [svg('<circle cx="100" cy="120" r="50" fill="#1f77b4"/>'), "I cannot draw this."]

    def policy(played, k):
        return answers[k] if k < len(answers) else played.solve()[0]

    episode = assert_same_episode(SVGEnv(), env, 3, policy, 3)
    assert 0.0 < episode[1].reward < 1.0 and episode[2].reward == 0.0 and episode[3].reward == 1.0


def test_generated_icons_stay_on_the_canvas():
    rng = np.random.default_rng(0)
    for _ in range(200):
        icon = generate_icon(rng)
        assert 2 <= len(icon.shapes) <= 5 and check_svg(icon.svg).svg == icon.svg
        geometry = re.sub(r"#[0-9a-f]{6}", "", icon.svg.split('height="256">')[1])  # colours are not coordinates
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", geometry)]
        assert all(-1 <= n <= 256 for n in numbers)


def test_expert_answer_solves_in_one_step(env):
    obs, _ = env.reset(seed=12)
    assert obs["text"] == "The image shows the target icon."
    (answer,) = env.solve()
    obs, reward, terminated, truncated, info = env.step(answer)
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert env.solve() == [] and "scored 1.000" in obs["text"]


def test_expert_solves_every_validation_seed_at_its_first_answer(env):
    for seed in range(30):
        env.reset(seed=seed)
        _, reward, terminated, _, info = env.step(env.solve()[0])
        assert (reward, terminated, info["success"]) == (1.0, True, True), seed


def test_revisions_until_max_steps(env):
    env.reset(seed=2)
    outcomes = [env.step(svg(""))[2:4] for _ in range(env.max_steps)]
    assert outcomes == [(False, False)] * (env.max_steps - 1) + [(False, True)]
    assert env.state_facts().extra["last_score"] < 0.35


def test_image_mode_shows_the_last_render(env):
    env.reset(seed=5)
    obs, *_ = env.step(svg('<rect width="256" height="256" fill="#000000"/>'))
    assert (obs["image"] == 0).all() and obs["text"].startswith("The image shows the render of your last SVG")


def test_text_mode_describes_every_shape():
    env = SVGEnv(mode="text")
    obs, _ = env.reset(seed=6)
    assert "image" not in obs
    for shape in env.icon.shapes:
        assert shape.description in obs["text"]
    assert set(obs["text"]) <= OBS_CHARSET and env.state_facts().extra["shapes"] == [
        shape.description for shape in env.icon.shapes
    ]


def test_copies_share_the_renderer_and_score_alike(env):
    env.reset(seed=8)
    shadow = copy.deepcopy(env)
    assert shadow.renderer is env.renderer
    answer = svg('<circle cx="128" cy="128" r="60" fill="#1f77b4"/>')
    assert shadow.step(answer)[1] == env.step(answer)[1]


@pytest.mark.parametrize(
    "settings_",
    [{"image_size": 8}, {"min_shapes": 3, "max_shapes": 2}, {"success_threshold": 0.0}, {"render_timeout_s": 0},
     {"pixel_weight": -1.0}, {"mode": "video"}, {"edge_weight": float("nan")}, {"ssim_weight": float("inf")},
     {"render_timeout_s": float("nan")}, {"render_timeout_s": float("inf")}],
)
def test_bad_settings_are_refused(settings_):
    """A NaN weight made every score NaN, clipped to a silent 0; a NaN or infinite timeout failed at the first
    render with a conversion error."""
    name = next(iter(settings_))
    with pytest.raises(ValueError, match=name):
        SVGEnv(**settings_)
