"""Packaging: the repository's top-level folders become subpackages of one ``kvconnect``.

The metadata lives in ``pyproject.toml``; this file only says where the packages are, as
``kvconnect/__init__.py`` does for a source checkout: ``connectors/`` is installed as
``kvconnect.connectors``, ``namespace/`` as ``kvconnect.namespace`` and ``benchmarks/`` as
``kvconnect.benchmarks``, so a wheel puts a single name, ``kvconnect``, into site-packages.
"""

from setuptools import find_packages, setup

FOLDERS = {"connectors": "kvconnect.connectors", "namespace": "kvconnect.namespace",
           "benchmarks": "kvconnect.benchmarks"}

package_dir = {"kvconnect": "kvconnect"}
packages = ["kvconnect"]
for folder, package in FOLDERS.items():
    package_dir[package] = folder
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]

# the W3 trace of ``kvconnect bench serve`` (its licence note beside it)
setup(package_dir=package_dir, packages=packages,
      package_data={"kvconnect.benchmarks.serving": ["data/*.jsonl.gz", "data/README.md"]})
