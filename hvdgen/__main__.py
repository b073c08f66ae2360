from hvdgen.cli import main

main()
