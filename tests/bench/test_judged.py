"""The judged-reply client's requests and parsing (vLLM's real responses go through it in the
end-to-end tests and the soak)."""

from __future__ import annotations

import pytest

from kvkeep.bench.criterion import TOP_ALTERNATIVES
from kvkeep.bench.judged import chat_body, completion_body, parse, path_of


def test_requests_are_greedy_with_token_ids_and_alternatives() -> None:
    body = completion_body("m", [5, 6], 4, salt="s")
    assert body["prompt"] == [5, 6] and body["cache_salt"] == "s" and body["model"] == "m"
    assert body["temperature"] == 0.0 and body["ignore_eos"] and body["return_tokens_as_token_ids"]
    assert body["logprobs"] == TOP_ALTERNATIVES
    assert path_of(body) == "/v1/completions"
    chat = chat_body("other", [{"role": "user", "content": "x"}], 3)
    assert chat["model"] == "other" and chat["top_logprobs"] == TOP_ALTERNATIVES
    assert chat["logprobs"] is True and "tools" not in chat and "cache_salt" not in chat
    assert path_of(chat) == "/v1/chat/completions"


def test_completion_and_chat_responses_parse_to_the_same_reply() -> None:
    usage = {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}
    completion = {
        "choices": [
            {
                "logprobs": {
                    "tokens": ["token_id:7", "token_id:9"],
                    "token_logprobs": [-0.5, -1.25],
                    "top_logprobs": [
                        {"token_id:7": -0.5, "token_id:8": -0.75},
                        {"token_id:9": -1.25, "token_id:3": -2.0},
                    ],
                }
            }
        ],
        "usage": usage,
    }
    chat = {
        "choices": [
            {
                "logprobs": {
                    "content": [
                        {
                            "token": "token_id:7",
                            "logprob": -0.5,
                            "top_logprobs": [
                                {"token": "token_id:7", "logprob": -0.5},
                                {"token": "token_id:8", "logprob": -0.75},
                            ],
                        },
                        {
                            "token": "token_id:9",
                            "logprob": -1.25,
                            "top_logprobs": [
                                {"token": "token_id:9", "logprob": -1.25},
                                {"token": "token_id:3", "logprob": -2.0},
                            ],
                        },
                    ]
                }
            }
        ],
        "usage": usage,
    }
    a, b = parse(completion), parse(chat)
    assert list(a.reply.token_ids) == list(b.reply.token_ids) == [7, 9]
    assert list(a.reply.logprobs) == list(b.reply.logprobs) == [-0.5, -1.25]
    assert list(a.reply.top) == list(b.reply.top) == [{7: -0.5, 8: -0.75}, {9: -1.25, 3: -2.0}]
    assert a.prompt_tokens == 300 and a.cached_tokens == b.cached_tokens == 256
    no_details = {**completion, "usage": {"prompt_tokens": 300, "prompt_tokens_details": None}}
    assert parse(no_details).cached_tokens == 0


def test_a_response_without_logprobs_is_an_error_not_an_empty_reply() -> None:
    with pytest.raises((KeyError, TypeError)):
        parse({"choices": [{"logprobs": None}], "usage": {"prompt_tokens": 1}})
