from ember_cli.main import main

main()
