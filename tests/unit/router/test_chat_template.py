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
    ],
    ids=["raise_exception", "mutation", "python-internals"],
)  # fmt: skip
def test_refusals_and_sandbox_violations_are_invalid_argument(source, message):
    template = ChatTemplate(source, {})
    with pytest.raises(RequestError) as err:
        template.render(HELLO)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith(message), err.value.message
