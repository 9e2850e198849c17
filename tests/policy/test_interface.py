"""The policy contract: what every backend declares for its callers, and the defaults it inherits."""

from turnrl.agent.formats import get_format
from turnrl.policy.interface import Policy
from turnrl.policy.openai_http import OpenAIPolicy
from turnrl.policy.scripted import ExpertPolicy, RandomPolicy


def test_text_only_policies_take_images_as_message_parts_and_have_no_weights():
    fmt = get_format("no_think")
    for policy in (OpenAIPolicy("http://x/v1", "m"), ExpertPolicy(fmt), RandomPolicy(fmt)):
        assert isinstance(policy, Policy)
        assert policy.tokenizer is None and policy.model is None and policy.image_encoder is None
        assert policy.accepts_images and list(policy.eos_ids) == [] and policy.max_batch_size is None
        assert policy.streaming() is None


def test_a_token_policy_takes_images_only_with_an_image_encoder(tiny_policy, tiny_vlm_policy):
    assert isinstance(tiny_policy, Policy) and tiny_policy.image_encoder is None and not tiny_policy.accepts_images
    assert tiny_vlm_policy.image_encoder is not None and tiny_vlm_policy.accepts_images
    for policy in (tiny_policy, tiny_vlm_policy):
        assert policy.model is not None and policy.eos_ids and policy.max_batch_size == 64
        assert policy.streaming() is None  # transformers' generate completes whole batches


def test_a_policy_of_its_own_inherits_the_defaults():
    class Echo(Policy):
        def generate(self, requests, sampling):
            return []

    echo = Echo()
    assert echo.tokenizer is None and echo.accepts_images and echo.streaming() is None
    echo.tokenizer = object()  # a token policy without an image encoder would play image envs blind
    assert not echo.accepts_images
