"""Installer for torchtune_lit, generated in the style of nbdev's template: everything comes from settings.ini.

    pip install -e .            runtime: torch, torchao, safetensors, datasets, sentencepiece, hub, omegaconf, tqdm
    pip install -e ".[dev]"     + the pinned nbdev 2 toolchain, jupyterlab, matplotlib, pytest, and the reference
                                libraries of the parity checks (transformers, peft, lm_eval, trl)
    pip install -e ".[docs]"    + Sphinx, myst-nb and the theme that render the teaching site offline
"""
from configparser import ConfigParser
import setuptools

config = ConfigParser(delimiters=["="])
config.read("settings.ini", encoding="utf-8")
cfg = config["DEFAULT"]

expected = "version description keywords author author_email license lib_name user min_python".split()
missing = [k for k in expected if k not in cfg]
if missing:
    raise SystemExit(f"settings.ini is missing {missing}: add them under [DEFAULT].")

licenses = {"apache2": "Apache-2.0"}  # an SPDX expression (license classifiers are deprecated)
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable",
            "6 - Mature", "7 - Inactive"]
py_versions = "3.10 3.11 3.12 3.13".split()

lic = licenses[cfg["license"]]
min_python = cfg["min_python"]
requirements = cfg.get("requirements", "").split()
dev_requirements = cfg.get("dev_requirements", "").split()
docs_requirements = cfg.get("docs_requirements", "").split()
plot_requirements = cfg.get("plot_requirements", "").split()
gguf_requirements = cfg.get("gguf_requirements", "").split()

setuptools.setup(
    name=cfg["lib_name"],
    license=lic,
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"]) - 1],  # status 3 = "3 - Alpha"
        "Intended Audience :: " + cfg["audience"].title(),
        "Natural Language :: " + cfg["language"].title(),
    ] + [f"Programming Language :: Python :: {o}" for o in py_versions[py_versions.index(min_python):]],
    url=cfg["git_url"],
    # namespace packages too, so the data folders (assets/, configs/) are packages setuptools knows about
    packages=setuptools.find_namespace_packages(include=["torchtune_lit", "torchtune_lit.*"]),
    include_package_data=True,
    package_data={"torchtune_lit": ["recipes/configs/**/*.yaml", "assets/**/*"]},
    install_requires=requirements,
    extras_require={"dev": dev_requirements, "docs": docs_requirements, "plot": plot_requirements,
                    "gguf": gguf_requirements},
    python_requires=">=" + min_python,
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    zip_safe=False,
    entry_points={
        "console_scripts": cfg.get("console_scripts", "").split(),
        "nbdev": [f'{cfg.get("lib_path")}={cfg.get("lib_path")}._modidx:d'],
    },
    version=cfg["version"],
    description=cfg["description"],
    keywords=cfg["keywords"],
    author=cfg["author"],
    author_email=cfg["author_email"],
)
