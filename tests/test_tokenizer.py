"""pagedllm's tokenizer (tokenizers + jinja2, no transformers) against transformers' own on the built-in
models: the same ids, the same text, the same chat prompts."""

import pytest
from transformers import AutoTokenizer

from pagedllm.models.loader import resolve_checkpoint
from pagedllm.models.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is",
    "  leading spaces and trailing  ",
    "héllo wörld — ünïcode ☃ 日本語テキスト 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "<bos>Hello<eos> there",
    "Don't stop , it 's fine .",
    "",
    "\n\n\t tabs",
    "def f(x):\n    return x**2",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Name three colors."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "¿Qué tal?"},
    ],
]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def pair(request):
    folder = resolve_checkpoint(request.param)
    return Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_match_transformers(pair, add_special_tokens):
    ours, theirs = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_vocabulary_match(pair):
    ours, theirs = pair
    assert len(ours) == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.special_tokens["bos_token"] == theirs.bos_token
    ids = ours.encode("Hello world", add_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    tokens = theirs.convert_ids_to_tokens(ids)
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens) == ids
    assert ours.convert_tokens_to_ids(tokens[0]) == ids[0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, theirs = pair
    assert (ours.chat_template is None) == (theirs.chat_template is None)
    if ours.chat_template is None:
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template(CONVERSATIONS[0])
        return
    for conversation in CONVERSATIONS:
        kwargs = {"add_generation_prompt": add_generation_prompt}
        assert ours.apply_chat_template(conversation, tokenize=False, **kwargs) == theirs.apply_chat_template(
            conversation, tokenize=False, **kwargs
        )
        assert ours.apply_chat_template(conversation, **kwargs) == list(
            theirs.apply_chat_template(conversation, return_dict=False, **kwargs)
        )
