"""Chat templates as the router loads and renders them: Hugging Face's places and forms,
errors that name the problem, and the sandbox."""

from __future__ import annotations

import json

import grpc
import pytest

from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.service.errors import RequestError

SIMPLE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}" \
         "{% if add_generation_prompt %}[assistant]{% endif %}"  # fmt: skip
HELLO = [{"role": "user", "content": "hi"}]


def write_config(path, **config) -> None:
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_no_template_is_none_not_an_error(tmp_path):
    assert ChatTemplate.load(tmp_path) is None
    write_config(tmp_path, bos_token="<s>")
    assert ChatTemplate.load(tmp_path) is None


def test_template_from_tokenizer_config_with_added_token_dicts(tmp_path):
    write_config(tmp_path, chat_template=SIMPLE, bos_token={"content": "<s>", "lstrip": False})
    assert ChatTemplate.load(tmp_path).render(HELLO) == "<s>[user]hi[assistant]"


def test_named_templates_use_default_and_a_jinja_file_wins(tmp_path):
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "x"},
                                          {"name": "default", "template": SIMPLE}])  # fmt: skip
    assert ChatTemplate.load(tmp_path).render(HELLO, add_generation_prompt=False) == "[user]hi"
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }} {{ messages | tojson }}")
    assert ChatTemplate.load(tmp_path).render(HELLO) == '1 [{"role": "user", "content": "hi"}]'


def test_a_broken_template_stops_the_router_at_start(tmp_path):
    write_config(tmp_path, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="the chat template does not compile"):
        ChatTemplate.load(tmp_path)


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{ raise_exception('roles must alternate') }}",
         "the model's chat template refused the messages: roles must alternate"),
        ("{{ messages.append(1) }}", "the model's chat template failed on these messages: SecurityError"),
        ("{{ ''.__class__.__mro__ }}", "the model's chat template failed on these messages"),
        # outside probe: these were HTTP 500s
        ("{{ 1 // (messages | length - 1) }}",
         "the model's chat template failed on these messages: ZeroDivisionError"),
        ("{% for i in range(10**9) %}{% endfor %}",
         "the model's chat template failed on these messages: OverflowError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
         "the model's chat template failed on these messages: RecursionError"),
    ],
    ids=["raise_exception", "mutation", "python-internals", "zero-division", "range", "recursion"],
)  # fmt: skip
def test_refusals_and_sandbox_violations_are_invalid_argument(source, message):
    template = ChatTemplate(source, {})
    with pytest.raises(RequestError) as err:
        template.render(HELLO)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith(message), err.value.message


# ---- against transformers' apply_chat_template ------------------------------------------

TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"}]  # fmt: skip
PLAIN = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
ORACLE_CASES = {
    # special tokens only in special_tokens_map.json (older checkpoints): BOS was dropped
    "legacy-map": ({"chat_template": PLAIN}, {"bos_token": {"content": "<s>", "lstrip": False}}),
    # a config with added_tokens_decoder is not legacy: its own tokens win over the map
    "config-wins": ({"chat_template": PLAIN, "bos_token": "</s>",
                     "added_tokens_decoder": {"1": {"content": "<s>", "special": True}}},
                    {"bos_token": "<s>"}),
    # tools and documents are defined as None: `is not none` was true for them
    "tools-documents": ({"chat_template": "{% if tools is not none %}TOOLS:{{ tools | tojson }}{% endif %}"
                                          "{% if documents is not none %}DOCS{% endif %}" + PLAIN}, None),
    # every named special token, and model-specific ones
    "sep-cls-mask": ({"chat_template": "{{ cls_token }}{% for m in messages %}{{ m.content }}{{ sep_token }}"
                                       "{% endfor %}{{ mask_token }}{{ image_token }}",
                      "cls_token": "<s>", "sep_token": "</s>", "mask_token": "<unk>",
                      "extra_special_tokens": {"image_token": "<unk>"}}, None),
    "unset-stays-undefined": ({"chat_template": "{{ 'sep' if sep_token is defined else 'none' }}" + PLAIN,
                               "bos_token": "<s>"}, None),
    # transformers' {% generation %} block (assistant masks): the router stopped at start
    "generation-block": ({"chat_template": "{% for m in messages %}{% if m.role == 'assistant' %}"
                                           "{% generation %}{{ m.content }}</s>{% endgeneration %}"
                                           "{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}"
                                           "{% if add_generation_prompt %}[assistant]{% endif %}"}, None),
}  # fmt: skip


@pytest.mark.parametrize("case", ORACLE_CASES)
def test_renders_as_transformers_renders(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    from tests.checkpoints import build_tokenizer

    config, special_map = ORACLE_CASES[case]
    build_tokenizer(64).save(str(tmp_path / "tokenizer.json"))
    write_config(tmp_path, **config)
    if special_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    expected = hf.apply_chat_template(TURNS, add_generation_prompt=True, tokenize=False)
    assert ChatTemplate.load(tmp_path).render(TURNS) == expected
