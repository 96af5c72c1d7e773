import pytest


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory for the hostile-input properties' files."""
    return tmp_path_factory.mktemp("hostile")
