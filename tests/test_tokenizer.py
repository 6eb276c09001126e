"""pagedllm's tokenizer (tokenizers + jinja2, no transformers) against transformers' own on the built-in
models: the same ids, the same text, the same chat prompts. And LLM.get_tokenizer(): transformers' own
tokenizer, as vLLM's is, agreeing with what the engine encodes and decodes."""

import pytest
from helpers import assert_all_blocks_free
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm import LLM, SamplingParams
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
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def theirs(model):
    """transformers' own tokenizer on the folder pagedllm converted the model into (the oracle)."""
    return AutoTokenizer.from_pretrained(str(resolve_checkpoint(model)))


@pytest.fixture(scope="module")
def pair(model, theirs):
    return Tokenizer(resolve_checkpoint(model)), theirs


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, kv_cache_memory="16MiB", max_model_len=256)


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


def test_get_tokenizer_is_transformers_tokenizer(llm, theirs):
    """What a transformers user calls on it gives what transformers' own tokenizer gives."""
    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerBase) and type(tok) is type(theirs)
    assert llm.get_tokenizer() is tok  # built once
    for text in TEXTS:
        assert tok(text).input_ids == theirs(text).input_ids == theirs.encode(text) == tok.encode(text), text
    assert tok(TEXTS).input_ids == theirs(TEXTS).input_ids
    ids = theirs.encode(TEXTS[2] + TEXTS[3])
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert (len(tok), tok.vocab_size, tok.eos_token_id, tok.bos_token_id) == (
        len(theirs),
        theirs.vocab_size,
        theirs.eos_token_id,
        theirs.bos_token_id,
    )
    assert tok.chat_template == theirs.chat_template
    if tok.chat_template is None:
        return
    for conversation in CONVERSATIONS:
        kwargs = {"add_generation_prompt": True}
        assert tok.apply_chat_template(conversation, tokenize=False, **kwargs) == theirs.apply_chat_template(
            conversation, tokenize=False, **kwargs
        )
        assert tok.apply_chat_template(conversation, tokenize=True, **kwargs)["input_ids"] == list(
            theirs.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
        )


def test_engine_encodes_and_decodes_as_get_tokenizer(llm):
    """The engine's prompt ids, chat prompts and output text are what get_tokenizer() makes of them."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", TEXTS[2]]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy), strict=True):
        assert out.prompt_token_ids == tok(prompt).input_ids
        completion = out.outputs[0]
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    if tok.chat_template is not None:
        for conversation, out in zip(CONVERSATIONS, llm.chat(CONVERSATIONS, greedy), strict=True):
            expected = tok.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
            assert out.prompt_token_ids == list(expected)
    assert_all_blocks_free(llm)


def test_get_tokenizer_is_none_without_a_tokenizer(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16)
    assert llm.engine.tokenizer is None and llm.get_tokenizer() is None
