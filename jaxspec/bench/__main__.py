from jaxspec.bench import main

main()
