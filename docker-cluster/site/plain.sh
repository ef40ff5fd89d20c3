#!/bin/bash
# Makes the plain site's image from the cluster image, once (devcluster.site
# commits the result): the cluster image has the packages the guide installs (the test cluster
# uses them, and torch and matplotlib with them); a plain site has not. Removed here, so the
# guide's own `apt-get install` lines must bring them. Done once per image rather than on every
# host at every start: removing torch on five hosts at once took minutes of the test's time.
set -euo pipefail
apt-get purge -qq -y --auto-remove python3-venv 'python3.*-venv' python3-pip-whl \
    python3-setuptools-whl python3-click python3-jinja2 python3-markupsafe python3-numpy \
    python3-xxhash python3-prometheus-client lua-filesystem >/dev/null
apt-get clean
echo "plain site image ready"
