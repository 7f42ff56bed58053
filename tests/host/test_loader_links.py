"""LoadLingbotPipeline loads only packages it listed, also when ``model`` arrives through a link.

ComfyUI 0.3.75 checks a combo's value against its options only when the value is typed into the
widget. A core STRING output (``PrimitiveString``) linked to the combo is refused by the link type check
(pinned below), but ComfyUI's own "any" output type ``IO.ANY`` (``"*"``, output by many custom-node
packs) matches every input, passes validation and hands the loader whatever string it carries. The
loader must refuse it itself; so must LoadLingbotPrompt, whose ``prompt_file`` combo lists the ``.json`` files
in ``input/``. Runs in ComfyUI's own executor in a child process (``inprocess_runner.py``, shared with
``test_encode_reset_inprocess.py``), which also counts safetensors opens and file opens under the
package while each prompt runs.
"""

from __future__ import annotations

import pytest

from support.inprocess_runner import FRAMES, H, LINK_VALUES, MODEL, OUTSIDE_CAPTION, W

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def links(inprocess_observations):
    return inprocess_observations["links"]


@pytest.mark.parametrize("name", list(LINK_VALUES))
def test_core_string_link_to_the_model_combo_fails_validation(links, name):
    run = links[f"PrimitiveString:{name}"]
    assert run["status"] == "invalid" and run["executed"] == []
    errors = run["validation"]["node_errors"]["2"]["errors"]
    assert [e["type"] for e in errors] == ["return_type_mismatch"]
    assert run["safe_opens"] == 0 and run["file_opens"] == 0


@pytest.mark.parametrize("name", list(LINK_VALUES))
def test_linked_path_or_unknown_name_is_refused_by_the_loader(links, name):
    run = links[f"AnyString:{name}"]
    assert run["status"] == "error", "a linked value the loader did not list was accepted"
    err = run["error"]
    assert (err["node_id"], err["node_type"], err["exception_type"]) == ("2", "LoadLingbotPipeline", "ValueError")
    message = err["exception_message"]
    assert f"model {run['value']!r} is not one of" in message  # names the input and the value
    assert f"({MODEL})" in message and "paths typed into the workflow are not accepted" in message  # what is allowed
    assert run["executed"] == ["1", "2"]  # nothing downstream of the loader ran
    assert run["safe_opens"] == 0, "weights were opened for a refused value"
    assert run["file_opens"] == 0, "files of the package were read for a refused value"


def test_a_listed_name_through_the_same_link_loads_and_generates(links):
    """After the refusals the host keeps working, and the counters above do see a real load."""
    run = links["AnyString:listed"]
    assert run["status"] == "success", run["error"]
    assert run["executed"] == ["1", "2", "3", "4"]
    assert run["frames"] == {"4": [[W, H]] * FRAMES}
    assert run["safe_opens"] > 0 and run["file_opens"] > 0


@pytest.mark.parametrize("name", ["dotdot", "absolute"])
def test_linked_prompt_file_outside_input_is_refused_unread(inprocess_observations, name):
    run = inprocess_observations["prompt_links"][name]
    assert run["status"] == "error", f"LoadLingbotPrompt read {run['value']!r} from outside input/: {run['texts']}"
    err = run["error"]
    assert (err["node_id"], err["node_type"], err["exception_type"]) == ("2", "LoadLingbotPrompt", "ValueError")
    assert f"prompt_file {run['value']!r} is not a .json file in ComfyUI's input folder" in err["exception_message"]
    assert OUTSIDE_CAPTION not in repr(run), "the outside file's text reached the user"
    assert run["outside_opens"] == 0 and run["executed"] == ["1", "2"]


def test_listed_prompt_file_through_the_same_link_loads(inprocess_observations):
    run = inprocess_observations["prompt_links"]["listed"]
    assert run["status"] == "success", run["error"]
    assert run["texts"]["3"] == ['{"caption":{"scene":"a listed kite"},"duration":1}']
