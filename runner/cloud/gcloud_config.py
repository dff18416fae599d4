"""gcloud's own defaults for --project and --zone, read from its configuration files (no gcloud process, no
network): the same answer `gcloud config get core/project` and `gcloud config get compute/zone` give.

gcloud's order, followed here: a CLOUDSDK_<SECTION>_<NAME> variable, then the active configuration's file
(CLOUDSDK_ACTIVE_CONFIG_NAME, else the name in CONFIG_DIR/active_config, else `default`), where CONFIG_DIR
is CLOUDSDK_CONFIG or ~/.config/gcloud (%APPDATA%\\gcloud on Windows). Installation-wide properties (a
`properties` file in the SDK's own folder) are not read: set the project or zone in a configuration.
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path


def config_dir() -> Path:
    if os.environ.get("CLOUDSDK_CONFIG"):
        return Path(os.environ["CLOUDSDK_CONFIG"])
    if os.name == "nt" and os.environ.get("APPDATA"):
        return Path(os.environ["APPDATA"]) / "gcloud"
    return Path.home() / ".config" / "gcloud"


def active_configuration() -> str:
    name = os.environ.get("CLOUDSDK_ACTIVE_CONFIG_NAME", "").strip()
    if name:
        return name
    try:
        return (config_dir() / "active_config").read_text().strip() or "default"
    except OSError:
        return "default"


def gcloud_property(section: str, name: str) -> str | None:
    """One property (e.g. `core`, `project`) as gcloud resolves it, or None when it is unset."""
    value = os.environ.get(f"CLOUDSDK_{section.upper()}_{name.upper()}", "").strip()
    if value:
        return value
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(config_dir() / "configurations" / f"config_{active_configuration()}")
    except configparser.Error:
        return None
    value = parser.get(section, name, fallback="").strip()
    return value or None


def default_project() -> str | None:
    return gcloud_property("core", "project")


def default_zone() -> str | None:
    return gcloud_property("compute", "zone")
