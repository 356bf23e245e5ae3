"""Configuration files shipped with the package: read them with ``smetric_lmc.config.packaged_config``."""
