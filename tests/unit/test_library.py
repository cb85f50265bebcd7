"""Which answers of Redis make a limiter use its scripts instead of its function library."""

from __future__ import annotations

import pytest
from redis.exceptions import NoPermissionError, ResponseError

from throttle.redis.library import Library


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        # Redis 7 without the commands, Redis 5 and 6 (which quote with backticks)
        (ResponseError("unknown command 'FCALL', with args beginning with: 'x' '3' "), True),
        (ResponseError("unknown command `FCALL`, with args beginning with: `x`, `3`, "), True),
        (ResponseError("unknown command `FUNCTION`, with args beginning with: `LOAD`, "), True),
        # an ACL without them
        (NoPermissionError("this user has no permissions to run the 'fcall' command"), True),
        (NoPermissionError("User u has no permissions to run the 'function|load' command"), True),
        # not a refusal of functions: raised as they are
        (NoPermissionError("this user has no permissions to access one of the keys used"), False),
        (NoPermissionError("User u has no permissions to run the 'setrange' command script: "
                           "throttle_x_acquire_one_tb, on @user_function:12."), False),
        (ResponseError("Function not found"), False),
        (ResponseError("user_function:12: attempt to compare nil with number"), False),
    ],
)  # fmt: skip
def test_only_a_refusal_of_fcall_or_function_load_turns_to_the_scripts(
    error: ResponseError, refused: bool
) -> None:
    library = Library(object())  # not a redis-py client: scripts already
    library.functions = None
    assert library.refused(error) is refused
    assert library.functions is (False if refused else None)


def test_a_missing_function_is_told_apart() -> None:
    assert Library.missing(ResponseError("Function not found"))
    assert not Library.missing(ResponseError("NOSCRIPT No matching script."))
    assert Library.exists(ResponseError("Library 'throttle_abc' already exists"))
