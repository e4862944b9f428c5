from autoconf.procs import die_with_parent_if_launched

die_with_parent_if_launched()  # launched by autoconf: die with torchrun, never outlive it

from autoconf.trainer.main import main  # noqa: E402

main()
