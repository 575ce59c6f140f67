"""tools/install.py: the Makefile's `pip install`, done by uv with pip's configuration carried over."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plait_install_tool", ROOT / "tools" / "install.py")
install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install)


def test_pips_configuration_becomes_uvs_variables_a_pip_variable_over_a_file():
    listed = "\n".join([
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/opt/wheels'",
        "user.find-links='/home/me/wheels /srv/wheels'",
        ":env:.default-timeout='180'",
        ":env:.find-links='/opt/env-wheels'",
        "global.no-cache-dir='true'",  # not carried: uv has its own cache
    ])
    assert install.uv_env(listed) == {
        "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
        "UV_CONSTRAINT": "/etc/xdg/pip/constraints.txt",
        "UV_EXTRA_INDEX_URL": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "UV_INDEX_STRATEGY": "unsafe-best-match",  # pip's choice: the best version over all indexes
        "UV_FIND_LINKS": "/opt/env-wheels",
        "UV_HTTP_TIMEOUT": "180",
    }
    assert install.uv_env("user.find-links='/home/me/wheels /srv/wheels'") == {"UV_FIND_LINKS": "/home/me/wheels,/srv/wheels"}
    assert install.uv_env("") == {}


def test_the_makefile_installs_through_it():
    make = (ROOT / "Makefile").read_text()
    assert "INSTALL := $(BIN)/python tools/install.py" in make
    assert "$(BIN)/pip install" not in make
