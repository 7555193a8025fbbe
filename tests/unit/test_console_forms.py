"""The console's submit form, read into a spec: each verify choice is the spec it names, and
a value the form never offers is refused by field."""

from __future__ import annotations

import pytest
from starlette.datastructures import FormData

from campugrid.console.forms import VERIFY, FormErrors, spec_of


@pytest.mark.parametrize("choice", sorted(VERIFY))
def test_each_verify_choice_is_the_spec_it_names(choice: str):
    spec = spec_of(FormData([("command", "echo hi"), ("verify", choice)]))
    named = VERIFY[choice]
    if named is None:
        assert spec.verify is None
    else:
        assert spec.to_dict()["verify"] == (named if isinstance(named, str) else
                                            {**spec.to_dict()["verify"], **named})
    if choice == "checkpoints":
        assert spec.verify is not None and not spec.verify.replicated
        assert spec.verify.checkpoints == 0.1


def test_a_verify_the_form_never_offers_is_refused_by_field():
    with pytest.raises(FormErrors) as err:
        spec_of(FormData([("command", "echo hi"), ("verify", "5")]))
    assert "verify" in err.value.fields
