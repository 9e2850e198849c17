"""Typed configuration: YAML plus ``key=value`` overrides into dataclasses, loud errors."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.hostile_text import too_deep
from turnrl.agent.formats import format_names
from turnrl.config import (
    LEVELS_PER_SEED,
    AgentConfig,
    ConfigError,
    EnvConfig,
    ModelConfig,
    SamplingConfig,
    SeedConfig,
    close_keys,
    config_keys,
    field_docs,
    given_keys,
    load_config,
    to_yaml,
)
from turnrl.eval_config import VARIANT_SETS, EvalConfig, VariantConfig

RECIPE = """\
env:
  id: Sokoban
  settings:
    size: 8
    num_boxes: 2
agent:
  format: grounding_worldmodeling
  max_turns: 7
  max_context_window: 3
sampling:
  temperature: 0.7
  stop: ["</answer>"]
policy: random
episodes: 12
"""


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


def error_of(path=None, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(EvalConfig, path, overrides)
    return str(info.value)


# --------------------------------------------------------------------------- loading
def test_defaults_load_without_file_or_overrides():
    config = load_config(EvalConfig)
    assert config == EvalConfig()


def test_yaml_loads_into_nested_dataclasses(recipe):
    config = load_config(EvalConfig, recipe)
    assert isinstance(config, EvalConfig)
    assert isinstance(config.env, EnvConfig) and isinstance(config.agent, AgentConfig)
    assert isinstance(config.sampling, SamplingConfig) and isinstance(config.model, ModelConfig)
    assert config.env.id == "Sokoban"
    assert config.env.settings == {"size": 8, "num_boxes": 2}
    assert config.agent.format == "grounding_worldmodeling"
    assert config.agent.max_turns == 7
    assert config.agent.max_context_window == 3
    assert config.sampling.temperature == 0.7
    assert config.sampling.stop == ["</answer>"]
    assert config.policy == "random" and config.episodes == 12
    # Keys the file leaves out keep their dataclass defaults.
    assert config.agent.max_actions_per_turn == AgentConfig().max_actions_per_turn
    assert config.model == ModelConfig()


def test_overrides_win_over_yaml_and_are_typed(recipe):
    config = load_config(
        EvalConfig,
        recipe,
        ["agent.max_turns=9", "sampling.temperature=0", "env.settings.size=6", "agent.max_context_window=null",
         "sampling.stop=[a,b]", "agent.format_reward=0.5"],
    )
    assert config.agent.max_turns == 9 and isinstance(config.agent.max_turns, int)
    assert config.sampling.temperature == 0.0 and isinstance(config.sampling.temperature, float)
    assert config.env.settings == {"size": 6, "num_boxes": 2}
    assert config.agent.max_context_window is None
    assert config.sampling.stop == ["a", "b"]
    assert config.agent.format_reward == 0.5


@pytest.mark.parametrize("text", ["off", "on", "no", "yes", "true", "1e3", "007", "0x10", "12"])
def test_a_text_key_takes_the_text_as_written_where_yaml_reads_a_boolean_or_a_number(text, tmp_path):
    """``run.name=off`` named the run directory ``False``: YAML reads the word as a boolean and OmegaConf writes it
    back into the str field as 'False'. In an override and in a file, a text key keeps the text."""
    from turnrl.training.train_config import TrainConfig

    assert load_config(TrainConfig, None, [f"run.name={text}"]).run.name == text
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"run:\n  name: {text}\n  steps: 3\nmodel:\n  path: {text}\n")
    config = load_config(TrainConfig, recipe)
    assert (config.run.name, config.model.path, config.run.steps) == (text, text, 3)
    # Quoted, a null, and a typed key as before.
    assert load_config(TrainConfig, None, ["run.name='off'"]).run.name == "off"
    assert load_config(TrainConfig, None, ["model.path=null"]).model.path is None
    assert load_config(TrainConfig, None, ["run.check_memory=off"]).run.check_memory is False
    # A list of text: each item as written.
    assert load_config(TrainConfig, None, [f"sampling.stop=[{text}, '{text}', x]"]).sampling.stop == [text, text, "x"]
    recipe.write_text(f"sampling:\n  stop: [{text}, x]\n")
    assert load_config(TrainConfig, recipe).sampling.stop == [text, "x"]


def test_later_override_of_the_same_key_wins():
    config = load_config(EvalConfig, None, ["episodes=3", "episodes=5"])
    assert config.episodes == 5


def test_to_yaml_round_trips(recipe, tmp_path):
    config = load_config(EvalConfig, recipe, ["seeds.seed=3", "agent.max_actions_per_turn=2"])
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(to_yaml(config))
    assert load_config(EvalConfig, dumped) == config


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("override", "suggestion"),
    [("agent.max_turn=3", "agent.max_turns"), ("max_turns=3", "agent.max_turns"),
     ("sampling.temprature=0.5", "sampling.temperature"), ("samplng.top_p=0.5", "sampling")],
)
def test_unknown_override_key_names_the_close_matches_on_one_line(override, suggestion):
    message = error_of(overrides=[override])
    assert override.split("=")[0].split(".")[0] in message
    assert f"did you mean {suggestion}" in message
    assert "\n" not in message and "turnrl config show" in message
    assert "env.val_settings" not in message, "the whole list of keys is not printed"


def test_an_unknown_key_far_from_any_other_still_says_where_to_look():
    message = error_of(overrides=["zzz=1"])
    assert "did you mean" not in message and "turnrl config show" in message


def test_unknown_key_in_yaml_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sampling:\n  temprature: 0.5\n")
    message = error_of(path)
    assert "temprature" in message and "sampling.temperature" in message


def test_skipped_sections_of_the_file_are_dropped_but_overrides_are_not(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("algorithm:\n  advantage: grpo\nagent:\n  max_turns: 3\n")
    config = load_config(EvalConfig, path, skip_sections={"algorithm"})
    assert config.agent.max_turns == 3
    with pytest.raises(ConfigError, match="algorithm"):
        load_config(EvalConfig, path, ["algorithm.advantage=gae"], skip_sections={"algorithm"})
    assert "algorithm" in error_of(path)


def test_wrong_type_names_the_key():
    message = error_of(overrides=["agent.max_turns=many"])
    assert "agent.max_turns" in message and "many" in message


def test_float_for_an_int_field_is_rejected():
    assert "agent.max_turns" in error_of(overrides=["agent.max_turns=1.5"])


def test_wrong_type_for_a_section_is_rejected():
    assert "env.settings" in error_of(overrides=["env.settings=5"])


def test_bad_choice_lists_the_allowed_values():
    message = error_of(overrides=["model.dtype=int8"])
    assert "model.dtype" in message and "int8" in message
    for allowed in ("auto", "float32", "bfloat16", "float16"):
        assert allowed in message


def test_unknown_response_format_is_rejected_at_load_time_listing_formats():
    message = error_of(overrides=["agent.format=bogus"])
    assert "agent.format" in message and "bogus" in message
    assert all(name in message for name in format_names())


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("agent.max_turns=0", "agent.max_turns"),
        ("agent.max_actions_per_episode=0", "agent.max_actions_per_episode"),
        ("agent.max_context_window=0", "agent.max_context_window"),
        ("sampling.temperature=-0.1", "sampling.temperature"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("sampling.max_new_tokens=0", "sampling.max_new_tokens"),
        ("episodes=0", "episodes"),
        ("batch_size=0", "batch_size"),
    ],
)
def test_out_of_range_value_names_the_key_and_the_range(override, key):
    message = error_of(overrides=[override])
    assert key in message and "range" in message


@pytest.mark.parametrize("override", ["agent.max_turns", "=3", "  =x"])
def test_malformed_override_is_a_config_error_naming_it(override):
    message = error_of(overrides=[override])
    assert repr(override) in message and "key=value" in message


def test_unparseable_override_value_is_a_config_error_naming_the_override():
    message = error_of(overrides=["agent.max_turns=[1,2"])
    assert "agent.max_turns=[1,2" in message


def test_missing_file_is_a_config_error(tmp_path):
    message = error_of(tmp_path / "nope.yaml")
    assert "nope.yaml" in message and "does not exist" in message


def test_malformed_yaml_file_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("agent:\n  max_turns: [1,\n")
    assert "broken.yaml" in error_of(path)


def test_a_config_file_that_is_not_text_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    message = error_of(path)
    assert "config.yaml" in message and "not UTF-8 text" in message


def test_yaml_file_that_is_not_a_mapping_is_a_config_error(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    message = error_of(path)
    assert "list.yaml" in message and "mapping" in message


@pytest.mark.parametrize("levels", [100, 500])
def test_settings_nested_deeper_than_python_reads_are_one_line(tmp_path, levels):
    """OmegaConf and PyYAML read a level by recursion: some hundred levels of keys, in the file or in an override's
    value, were a RecursionError's traceback."""
    path = tmp_path / "deep.yaml"
    path.write_text("env:\n  settings:\n" + "".join(" " * (i + 4) + f"k{i}:\n" for i in range(levels))
                    + " " * (levels + 4) + "v: 1\n")
    assert error_of(path) == f"config file {str(path)!r} is not valid YAML: nested deeper than Python can read"
    value = "{a: " * levels + "1" + "}" * levels  # past OmegaConf's own limit of flow levels (about 1,000) it says so
    assert error_of(overrides=[f"env.settings={value}"]) == (
        "override env.settings=...: the value is nested deeper than Python can read")


def test_overlapping_seed_ranges_are_rejected_at_load_time():
    message = error_of(overrides=["seeds.train_start=5"])
    assert "seeds.train_start" in message and "overlap" in message


def test_negative_env_seeds_are_rejected_at_load_time():
    assert "seeds.val_start" in error_of(overrides=["seeds.val_start=-100", "seeds.val_size=10", "seeds.train_start=0"])


def test_more_episodes_than_validation_seeds_are_rejected_at_load_time():
    message = error_of(overrides=["seeds.val_size=10", "episodes=11"])
    assert "episodes" in message and "seeds.val_size" in message


def test_seed_config_accepts_training_right_after_validation():
    config = load_config(EvalConfig, None, ["seeds.val_start=100", "seeds.val_size=50", "seeds.train_start=150"])
    assert config.seeds == SeedConfig(seed=0, train_start=150, val_start=100, val_size=50)


# --------------------------------------------------------------------------- documentation of keys
def test_every_key_has_its_default_and_its_docstring():
    keys = {item.key: item for item in config_keys(EvalConfig)}
    assert keys["agent.max_turns"].default == AgentConfig().max_turns
    assert keys["agent.max_turns"].doc.startswith("Model responses per episode")
    assert keys["sampling.temperature"].default == 0.5  # the section's own default, not SamplingConfig's
    assert keys["policy"].default == "expert"
    undocumented = [key for key, item in keys.items() if not item.doc]
    assert not undocumented, f"keys without a docstring: {undocumented}"
    assert "\n" not in keys["agent.max_images"].doc, "a doc is one line"


def test_field_docs_of_a_class_without_source_is_empty():
    klass = type("Made", (), {})
    assert field_docs(klass) == {}


def test_given_keys_are_the_file_and_override_keys_with_their_sections(recipe):
    keys = given_keys(recipe, ["agent.max_actions_per_turn=2", "out=x"], skip_sections={"sampling"})
    assert {"env", "env.id", "env.settings.size", "agent.max_turns", "agent.max_actions_per_turn", "out"} <= keys
    assert "sampling.temperature" not in keys and "agent.max_images" not in keys
    assert given_keys(None, None) == set()
    assert given_keys(recipe.parent / "missing.yaml", ["a.b=1"]) == {"a", "a.b"}


@settings(max_examples=200, deadline=None)
@given(text=st.text(), overrides=st.lists(st.text(), max_size=4))
@example(text="env: " + too_deep("- "), overrides=[])
def test_given_keys_takes_any_text_without_raising(tmp_path_factory, text, overrides):
    path = tmp_path_factory.getbasetemp() / "any.yaml"
    path.write_text(text)
    keys = given_keys(path, overrides)
    assert all(isinstance(key, str) for key in keys)


EVAL_KEYS = [item.key for item in config_keys(EvalConfig)]  # read from the source once, not once an example


@settings(max_examples=200, deadline=None)
@given(key=st.text())
def test_close_keys_takes_any_key(key):
    assert len(close_keys(key, EVAL_KEYS)) <= 3


OVERRIDE = st.text() | st.builds("{}={}".format, st.sampled_from(EVAL_KEYS) | st.text(max_size=8), st.text())
"""Any text, and key=value with a real key (and a value of any text) or any key."""


@settings(max_examples=100, deadline=None)
@given(overrides=st.lists(OVERRIDE, max_size=3))
@example(overrides=["[=1"])  # OmegaConf's IndexError splitting the key
@example(overrides=["env.id=${"])  # its GrammarParseError reading the interpolation
@example(overrides=["env.id=${nothing}"])  # its InterpolationKeyError resolving it
@example(overrides=["env.id=0\t0"])  # text to OmegaConf, a ScannerError to YAML's reading as written
def test_any_overrides_are_settings_or_one_line_saying_what_is_wrong(overrides):
    try:
        load_config(EvalConfig, None, overrides)
    except ConfigError as error:
        assert str(error) and "\n" not in str(error)


@pytest.mark.parametrize(("override", "said"), [
    ("[=1", "override '[=1': its key is no dotted name; write key=value, e.g. agent.max_turns=5"),
    ("env.id=${", "override 'env.id=${': config key 'env.id': no viable alternative at input '${'"),
    ("env.id=${nothing}", "override 'env.id=${nothing}': config key 'env.id': Interpolation key 'nothing' not found"),
])
def test_an_override_omegaconf_cannot_read_is_one_line(override, said, tmp_path):
    assert error_of(overrides=[override]) == said
    path = tmp_path / "config.yaml"
    path.write_text("env:\n  id: " + override.split("=", 1)[1] + "\n")
    if "$" in override:  # the same value in a file
        assert error_of(path) == f"config file {str(path)!r}: {said.split(': ', 1)[1]}"


# --------------------------------------------------------------------------- env variants
def test_variants_load_as_typed_records_and_the_ragen_set_is_valid(tmp_path):
    path = tmp_path / "variants.yaml"
    path.write_text("env: {id: Sokoban}\nvariants:\n  - {name: larger, settings: {size: 8, num_boxes: 2}}\n"
                    "  - {name: lake, env: FrozenLake}\n")
    config = load_config(EvalConfig, path)
    assert config.variants == [VariantConfig("larger", None, {"size": 8, "num_boxes": 2}),
                               VariantConfig("lake", "FrozenLake", {})]
    ragen = EvalConfig(variants=list(VARIANT_SETS["ragen"]))
    ragen.validate()
    assert [(v.env, v.settings) for v in ragen.variants] == [
        ("Sokoban", {"size": 6, "num_boxes": 1}), ("Sokoban", {"size": 8, "num_boxes": 2, "search_depth": 10}),
        ("Sokoban", {"size": 6, "num_boxes": 1, "symbols": "alt"}),
        ("FrozenLake", {"size": 4, "p_frozen": 0.9, "is_slippery": True, "success_rate": 0.8})]


@pytest.mark.parametrize(("variants", "needle"), [
    ("[{env: Sokoban}]", "'variants[0].name'"),
    ("[{name: a, envv: Sokoban}]", "'envv' not in 'VariantConfig'; did you mean env?"),
    ("[{name: a, settings: 3}]", "'settings': Cannot assign int"),
    ("[{name: a}, {name: a}]", "variants[1].name='a' is used twice"),
    ("[{name: a/b}]", "variants[0].name='a/b' must be a folder name"),
    ("[{name: ''}]", "must be a folder name"),
    ("[{name: a, env: ' '}]", "variants[0].env is empty"),
])
def test_a_bad_variant_is_a_config_error_naming_it(variants, needle):
    assert needle in error_of(overrides=[f"variants={variants}"])


def test_an_override_into_a_list_item_says_to_set_the_whole_list():
    message = error_of(overrides=["variants=[{name: a}]", "variants.0.settings.size=8"])
    assert message.startswith("override 'variants.0.settings.size=8' sets an item of a list by its index")
    assert "variants=[{name: big, settings: {size: 8}}]" in message


def test_levels_follow_the_seed_from_a_seed_of_zero_or_more():
    assert SeedConfig(seed=2).first_train_seed() == 10_000
    assert SeedConfig(seed=2, levels_follow_seed=True).first_train_seed() == 10_000 + 2 * LEVELS_PER_SEED
    assert SeedConfig(seed=0, levels_follow_seed=True).first_train_seed() == 10_000
    assert "seeds.seed=-1 is out of range" in error_of(overrides=["seeds.seed=-1", "seeds.levels_follow_seed=true"])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".nan"])
def test_a_float_that_is_not_finite_is_refused_naming_its_key(value):
    # NaN passes every bound (it compares false), inf is no setting: both would reach the sampler.
    assert error_of(overrides=[f"sampling.temperature={value}"]).startswith("sampling.temperature=")
    assert "must be a finite number" in error_of(overrides=[f"sampling.temperature={value}"])


def test_an_empty_stop_string_is_refused_it_would_end_every_response_after_one_token():
    assert "holds an empty stop string" in error_of(overrides=["sampling.stop=['</answer>', '']"])
    assert "validation.sampling" not in error_of(overrides=["sampling.stop=['']"])


def test_every_built_in_chat_template_is_a_built_in_models_choice():
    from turnrl.chat.templates import TEMPLATES

    for name in TEMPLATES:
        assert load_config(EvalConfig, None, [f"model.builtin_template={name}"]).model.builtin_template == name
    assert "qwen3_thinking" in error_of(overrides=["model.builtin_template=qwen4"])


def test_a_config_file_that_is_a_folder_says_so(tmp_path):
    assert error_of(path=tmp_path) == f"config file {str(tmp_path)!r} is a folder; pass a YAML file"


@pytest.mark.parametrize(("override", "expected"), [
    ("agent.max_turns=", "override 'agent.max_turns=' gives no value; write agent.max_turns=VALUE"),
    ("sampling.stop=abc", "config key 'sampling.stop' takes a list, e.g. sampling.stop=[a, b]"),
    ("agent=3", "override 'agent=3' gives a value to the section agent; set its keys, e.g. agent.KEY=VALUE"),
])
def test_a_value_of_the_wrong_shape_is_said_in_the_users_words(override, expected):
    # OmegaConf said "Incompatible value 'None'", "AnyNode is not a ListConfig", "int is not a subclass of ...".
    assert error_of(overrides=[override]).startswith(expected)


def test_an_unknown_key_without_a_value_is_called_unknown():
    assert "did you mean agent.max_turns?" in error_of(overrides=["agent.max_turn="])


@pytest.mark.parametrize(("text", "problem"), [
    ("a: [\n", "did not find expected node content at line 2, column 1"),
    ("a: 1\na: 2\n", "found duplicate key a at line 2, column 1"),
])
def test_a_yaml_file_that_does_not_parse_is_one_line_with_its_place(tmp_path, text, problem):
    # PyYAML's own text took four lines, two of them the place of the enclosing context.
    (tmp_path / "bad.yaml").write_text(text)
    message = error_of(path=tmp_path / "bad.yaml")
    assert message == f"config file {str(tmp_path / 'bad.yaml')!r} is not valid YAML: {problem}"


def test_an_override_that_does_not_parse_is_one_line():
    message = error_of(overrides=["agent.max_turns=[1"])
    assert "\n" not in message and "did not find expected ',' or ']'" in message


@pytest.mark.parametrize(("override", "message"), [
    ("env.settings=[1]", "config key 'env.settings' takes a mapping, e.g. env.settings={KEY: VALUE}"),
    ("sampling.stop={a: 1}", "config key 'sampling.stop' takes a list, e.g. sampling.stop=[a, b]"),
])
def test_a_list_for_a_mapping_or_a_mapping_for_a_list_names_the_key(override, message, tmp_path):
    # Both read "an override sets an item of a list by its index ... e.g. variants=[...]", of no key given.
    with pytest.raises(ConfigError) as info:
        load_config(EvalConfig, None, [override])
    assert str(info.value) == message
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("env:\n  settings: [1, 2]\n")
    with pytest.raises(ConfigError, match="config key 'env.settings' takes a mapping"):
        load_config(EvalConfig, recipe)
    with pytest.raises(ConfigError, match="override 'sampling.stop.0=x' sets an item of a list by its index"):
        load_config(EvalConfig, None, ["sampling.stop.0=x"])


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "cuda:-1", "CPU"])
def test_a_device_that_is_none_stops_at_load_time(device):
    # torch refused it only once a model loaded, as a traceback.
    with pytest.raises(ConfigError, match=r"model.device=.* is not allowed; choose one of \['auto', 'cpu', 'cuda', "
                                          r"'cuda:N'\]"):
        load_config(EvalConfig, None, [f"model.device={device}"])


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_every_device_torch_places_a_model_on_loads(device):
    assert load_config(EvalConfig, None, [f"model.device={device}"]).model.device == device


def train_error_of(text: str | None, overrides: list[str], tmp_path) -> str:
    from turnrl.training.train_config import TrainConfig

    path = None
    if text is not None:
        path = tmp_path / "recipe.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path, overrides)
    return str(info.value).replace(repr(str(path)), "FILE")


@pytest.mark.parametrize(("text", "overrides", "expected"), [
    ("run: [1, 2]\n", [], "config file FILE gives a value to the section run (run: [1, 2]); a section takes a mapping "
                          "of its keys, e.g. run: {KEY: VALUE}"),
    (None, ["run=[1, 2]"], "override 'run=[1, 2]' gives a value to the section run; set its keys, e.g. run.KEY=VALUE"),
    ("env: Sokoban\n", [], "config file FILE gives a value to the section env (env: Sokoban); a section takes a "
                           "mapping of its keys, e.g. env: {KEY: VALUE}"),
    ("algorithm: {filter: topk}\n", [], "config file FILE gives a value to the section algorithm.filter (algorithm: "
                                        "{filter: topk}); a section takes a mapping of its keys, e.g. algorithm: "
                                        "{filter: {KEY: VALUE}}"),
    ("agent: {max_turns: [1, 2]}\n", [], "config key 'agent.max_turns' takes one value, not a list; write agent: "
                                         "{max_turns: VALUE}"),
    (None, ["agent.max_turns=[1, 2]"], "config key 'agent.max_turns' takes one value, not a list; write "
                                       "agent.max_turns=VALUE"),
    (None, ["run.name={a: 1}"], "config key 'run.name' takes one value, not a mapping; write run.name=VALUE"),
    ("sampling: {stop: {a: 1}}\n", [], "config key 'sampling.stop' takes a list, e.g. sampling: {stop: [a, b]}"),
    ("env: {settings: 6}\n", [], "config key 'env.settings' takes a mapping, e.g. env: {settings: {KEY: VALUE}}"),
    (None, ["env.settings=6"], "config key 'env.settings' takes a mapping, e.g. env.settings={KEY: VALUE}"),
])
def test_a_value_of_the_wrong_shape_in_a_file_or_an_override_says_what_to_write(text, overrides, expected, tmp_path):
    # A section as a list was a traceback from the reading of text keys ("Index 'output_dir' (str) is not an int");
    # the others named OmegaConf's classes ("Cannot assign int to Dict[str, Any]", "... to ListConfig").
    message = train_error_of(text, overrides, tmp_path)
    assert message.startswith(expected) and "\n" not in message


def test_a_dotted_key_in_a_file_says_that_a_file_nests_its_keys(tmp_path):
    # It read "Key 'run.steps' not in 'TrainConfig'; did you mean run.steps ...?", the key written.
    assert train_error_of("run.steps: 2\n", [], tmp_path) == (
        "config file FILE writes the dotted key 'run.steps'; a file nests its keys, as run: {steps: 2} (dotted keys "
        "are for overrides: run.steps=2)")
    assert "as env: {settings: {size: 6}}" in train_error_of("env:\n  settings.size: 6\n", [], tmp_path)


def test_null_for_a_text_key_that_needs_a_text_says_how_to_write_the_word(tmp_path):
    # "Incompatible value 'None' for field of type 'str'": null is no text, and the quoted word is one.
    from turnrl.training.train_config import TrainConfig

    assert train_error_of(None, ["run.name=null"], tmp_path) == (
        "config key 'run.name' takes a text, not null; write run.name=TEXT, or run.name='null' for the word itself")
    assert train_error_of("run: {name: }\n", [], tmp_path).startswith(
        "config key 'run.name' takes a text, not null; write run: {name: TEXT}")
    assert train_error_of(None, ["agent.max_turns=null"], tmp_path) == (
        "config key 'agent.max_turns' needs a value, not null; write agent.max_turns=VALUE")
    assert load_config(TrainConfig, None, ["run.name='null'"]).run.name == "null"
    assert load_config(TrainConfig, None, ["model.path=null", "env.val_settings=null"]).model.path is None


@pytest.mark.parametrize(("override", "hint"), [
    ("algorithm.filter.method=topk", "; did you mean top_k?"), ("algorithm.kl_kind=K3", "; did you mean k3?"),
    ("algorithm.sample_mode=turns", "; did you mean turn?"), ("algorithm.filter.method=xyz", ""),
])
def test_a_choice_with_a_near_miss_suggests_the_close_value(override, hint, tmp_path):
    # A Literal key read OmegaConf's "Invalid value 'topk', expected one of [...]", and no choice suggested.
    key, value = override.split("=")
    message = train_error_of(None, [override], tmp_path)
    assert message.startswith(f"{key}={value!r} is not allowed; choose one of [") and message.endswith(f"]{hint}")
