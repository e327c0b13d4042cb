"""Tools built on the library: lessons (``explain``), pictures and pages (``viz``), measurements
(``bench``) and machine facts (``info``). Each is a library of its own; the command line in
:mod:`attnlab.cli` is a thin layer over them."""
