"""Package discovery for the mapped layout (pyproject.toml holds everything else).

``controller/``, ``workers/`` and ``configs/`` sit at the top of the repository and install as
``smetric_lmc.controller``, ``.workers`` and ``.configs``. setuptools' ``packages.find`` cannot
prefix a folder's packages with another name, so they are found here: a new sub-package of any of
the four is picked up without editing a list (a hand-kept one once left ``smetric_lmc.index`` out
of non-editable installs).
"""

from setuptools import find_packages, setup

#: Installed package name -> folder in the repository.
PACKAGE_DIR = {
    "smetric_lmc": "smetric_lmc",
    "smetric_lmc.controller": "controller",
    "smetric_lmc.workers": "workers",
    "smetric_lmc.configs": "configs",
}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIR.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


setup(packages=packages(), package_dir=PACKAGE_DIR)
