"""Every GenerateRequest field is checked while parsing, with an error naming the field."""

from __future__ import annotations

import math

import pytest

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError
from kvserve.scheduler.server.intake.request_parsing import ModelLimits, parse_generate
from kvserve.scheduler.server.intake.served_models import ModelNotFound, ServedModels
from kvserve.scheduler.server.intake.tokenizer import Tokenizer

LIMITS = ModelLimits(max_model_len=64, vocab_size=49152)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _request(**sampling) -> api_pb2.GenerateRequest:
    stop = sampling.pop("stop", [])
    stop_ids = sampling.pop("stop_token_ids", [])
    return api_pb2.GenerateRequest(
        text="Hello there", sampling=api_pb2.SamplingParams(stop=stop, stop_token_ids=stop_ids, **sampling)
    )


BAD_REQUESTS = [
    (api_pb2.GenerateRequest(), "prompt"),
    (api_pb2.GenerateRequest(text=""), "text"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[])), "token_ids"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[1, 49152])), "token_ids"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[-1])), "token_ids"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[5] * 64)), "token_ids"),
    (api_pb2.GenerateRequest(text="word " * 200), "text"),
    (api_pb2.GenerateRequest(text="x" * (defaults.MAX_PROMPT_CHARS + 1)), "text"),
    (api_pb2.GenerateRequest(chat=api_pb2.ChatPrompt()), "chat.messages"),
    (
        api_pb2.GenerateRequest(chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="root", content="x")])),
        "chat.messages[0].role",
    ),
    (_request(max_tokens=0), "sampling.max_tokens"),
    (_request(max_tokens=-5), "sampling.max_tokens"),
    (_request(max_tokens=64), "sampling.max_tokens"),
    (_request(temperature=math.nan), "sampling.temperature"),
    (_request(temperature=-0.5), "sampling.temperature"),
    (_request(top_p=0.0), "sampling.top_p"),
    (_request(top_p=1.5), "sampling.top_p"),
    (_request(top_p=math.inf), "sampling.top_p"),
    (_request(top_k=-2), "sampling.top_k"),
    (_request(n=defaults.MAX_N + 1), "sampling.n"),
    (_request(n=0), "sampling.n"),
    (_request(seed=-1), "sampling.seed"),
    (_request(stop=["s"] * (defaults.MAX_STOP_STRINGS + 1)), "sampling.stop"),
    (_request(stop=["x" * (defaults.MAX_STOP_STRING_CHARS + 1)]), "sampling.stop"),
    (_request(stop=[""]), "sampling.stop"),
    (_request(stop_token_ids=[49152]), "sampling.stop_token_ids"),
    (_request(logprobs=defaults.MAX_LOGPROBS + 1), "sampling.logprobs"),
    (api_pb2.GenerateRequest(text="hi", request_id="x" * 200), "request_id"),
    (api_pb2.GenerateRequest(text="hi", request_id="bad\nid"), "request_id"),
    (api_pb2.GenerateRequest(text="hi", cache_salt="s" * 1000), "cache_salt"),
    (api_pb2.GenerateRequest(text="hi", priority=2**40), "priority"),
]


@pytest.mark.parametrize(("request_pb", "field"), BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_field_is_named(tokenizer: Tokenizer, request_pb: api_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidFieldError) as info:
        parse_generate(request_pb, tokenizer, LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_valid_request_maps_every_field(tokenizer: Tokenizer) -> None:
    request = api_pb2.GenerateRequest(
        text="Hello there",
        request_id="req-1",
        priority=-3,
        cache_salt="team-a",
        sampling=api_pb2.SamplingParams(
            temperature=0.0,
            top_k=5,
            top_p=0.9,
            min_p=0.1,
            seed=7,
            n=2,
            max_tokens=8,
            min_tokens=2,
            stop=["\n"],
            stop_token_ids=[2],
            ignore_eos=True,
            logprobs=3,
        ),
    )
    v = parse_generate(request, tokenizer, LIMITS)
    assert v.request_id == "req-1" and v.priority == -3 and v.cache_salt == "team-a"
    assert v.prompt_token_ids == tuple(tokenizer.encode("Hello there"))
    s = v.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.n, s.max_tokens, s.min_tokens) == (
        0.0,
        5,
        0.9,
        0.1,
        7,
        2,
        8,
        2,
    )
    assert s.stop == ("\n",) and s.stop_token_ids == (2,) and s.ignore_eos and s.logprobs == 3


def test_unset_max_tokens_is_clamped_to_the_context(tokenizer: Tokenizer) -> None:
    ids = list(range(10, 60))  # 50 tokens of a 64-token context
    v = parse_generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids)), tokenizer, LIMITS)
    assert v.sampling.max_tokens == 14
    assert v.request_id  # assigned by the server


@pytest.mark.parametrize(("sent", "stored"), [(0, -1), (-1, -1), (1, 1), (40, 40)])
def test_top_k_zero_means_off_like_minus_one(tokenizer: Tokenizer, sent: int, stored: int) -> None:
    """0 and -1 both switch top-k off; SamplingParams (and the executor) hold -1 for off."""
    assert parse_generate(_request(top_k=sent), tokenizer, LIMITS).sampling.top_k == stored


def test_unset_top_k_is_off(tokenizer: Tokenizer) -> None:
    assert parse_generate(_request(), tokenizer, LIMITS).sampling.top_k == -1


def test_chat_prompt_uses_the_template(tokenizer: Tokenizer) -> None:
    chat = api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="user", content="Hi")])
    v = parse_generate(api_pb2.GenerateRequest(chat=chat), tokenizer, ModelLimits(2048, 49152))
    assert tokenizer.decode(v.prompt_token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def _requests():
    from hypothesis import strategies as st

    ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 70))
    floats = st.floats(allow_nan=True, allow_infinity=True)
    text = st.text(max_size=200)
    sampling = st.builds(
        api_pb2.SamplingParams,
        temperature=floats,
        top_k=ints,
        top_p=floats,
        min_p=floats,
        repetition_penalty=floats,
        presence_penalty=floats,
        frequency_penalty=floats,
        seed=ints,
        n=ints,
        max_tokens=ints,
        min_tokens=ints,
        stop_token_ids=st.lists(ints, max_size=70),
        stop=st.lists(st.text(max_size=300), max_size=20),
        ignore_eos=st.booleans(),
        logprobs=ints,
    )
    chat = st.builds(
        api_pb2.ChatPrompt,
        messages=st.lists(
            st.builds(
                api_pb2.ChatMessage,
                role=st.sampled_from(["system", "user", "assistant", "tool", "", "x"]),
                content=text,
            ),
            max_size=4,
        ),
    )
    prompt = st.one_of(
        st.fixed_dictionaries({"text": text}),
        st.fixed_dictionaries({"token_ids": st.builds(api_pb2.TokenIds, ids=st.lists(ints, max_size=80))}),
        st.fixed_dictionaries({"chat": chat}),
        st.just({}),
    )
    return st.builds(
        lambda p, s, rid, prio, salt: api_pb2.GenerateRequest(
            **p, sampling=s, request_id=rid, priority=prio, cache_salt=salt
        ),
        prompt,
        sampling,
        st.text(max_size=140),
        ints,
        st.text(max_size=300),
    )


def test_random_requests_either_validate_or_name_a_field(tokenizer: Tokenizer) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_requests())
    def check(request: api_pb2.GenerateRequest) -> None:
        try:
            v = parse_generate(request, tokenizer, LIMITS)
        except InvalidFieldError as exc:
            assert exc.field and str(exc).startswith(exc.field + ": ")
            return
        assert 0 < len(v.prompt_token_ids) < LIMITS.max_model_len
        assert all(0 <= t < LIMITS.vocab_size for t in v.prompt_token_ids)
        assert 1 <= v.sampling.max_tokens <= LIMITS.max_model_len - len(v.prompt_token_ids)
        v.sampling.validate()

    check()


SERVED = ServedModels.of("base-model", ("alias",), ("alpha", "beta"))


@pytest.mark.parametrize(
    "name, lora", [("", ""), ("base-model", ""), ("alias", ""), ("alpha", "alpha"), ("beta", "beta")]
)
def test_the_model_field_picks_the_base_model_or_a_lora_adapter(tokenizer: Tokenizer, name: str, lora: str) -> None:
    limits = ModelLimits(max_model_len=64, vocab_size=49152, models=SERVED)
    assert parse_generate(api_pb2.GenerateRequest(text="Hi", model=name), tokenizer, limits).lora_name == lora


def test_an_unknown_model_is_refused_first_naming_it_and_what_is_served(tokenizer: Tokenizer) -> None:
    limits = ModelLimits(max_model_len=64, vocab_size=49152, models=SERVED)
    bad_prompt_too = api_pb2.GenerateRequest(text="", model="gamma")
    with pytest.raises(ModelNotFound) as info:
        parse_generate(bad_prompt_too, tokenizer, limits)
    assert info.value.field == "model" and isinstance(info.value, InvalidFieldError)
    assert str(info.value) == (
        "model: the model 'gamma' does not exist; this server serves 'base-model', 'alias', 'alpha', 'beta'"
    )
    with pytest.raises(ModelNotFound, match="'" + "x" * 200 + "' does not"):
        parse_generate(api_pb2.GenerateRequest(text="Hi", model="x" * 10_000), tokenizer, limits)


def test_an_adapter_may_not_take_a_name_of_the_base_model() -> None:
    with pytest.raises(ValueError, match="'alias' is also a name of the base model"):
        ServedModels.of("base-model", ("alias",), ("alias", "alpha"))
    assert ServedModels.of("m", ("m", "n"), ("a",)).names() == ("m", "n", "a")
